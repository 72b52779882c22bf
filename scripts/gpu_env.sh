# Source this on a GPU machine that has Python with numpy, torch and cuda-bindings but not the project installed:
# the wheels in .whl/ (the project's dependencies, fetched where PyPI is reachable) into /tmp/site once, the runtime
# importable as imp_runtime (a link to runtime/), the project's root on the path.
#   source scripts/gpu_env.sh
_imp_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ ! -d /tmp/site ] && compgen -G "$_imp_root/.whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$_imp_root"/.whl/*.whl
fi
mkdir -p /tmp/pk && ln -sfn "$_imp_root/runtime" /tmp/pk/imp_runtime
export PYTHONPATH="$_imp_root:/tmp/pk:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset _imp_root
