"""The compiler's one error type: what the user gave cannot be compiled, said in one line with what to do."""


class CompileError(Exception):
    """A checkpoint, option or model the compiler cannot handle; the message is for the user."""


def data_dir(name: str):
    """A folder the compiler reads (templates/, targets/): beside the package in a source tree, inside it
    once installed (pyproject.toml maps the folders to impc.templates and impc.targets)."""
    from pathlib import Path
    here = Path(__file__).resolve().parent
    for path in (here.parent / name, here / name):
        if path.is_dir():
            return path
    raise CompileError(f"the compiler's {name}/ folder is missing from this installation; reinstall imp")
