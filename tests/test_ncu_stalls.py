"""scripts/ncu_stalls.py over a hand-written report page: the shares and the instruction ranking are computed here
from the rows' numbers, not read from the script."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HDR = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
       "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]
ROWS = [["0x10", "LDG.E.128 R4, desc[UR8][R56.64]", "5", "5", "1", "4", "1"],
        ["0x20", "STS.128 [R60+UR4], R4", "30", "30", "27", "3", "27"],
        ["0x30", "HMMA.16816.F32 R8, R12, R16, R8", "15", "10", "0", "15", "0"]]


def test_shares_and_ranking(tmp_path):
    page = tmp_path / "sass.csv"
    page.write_text('"Kernel Name","gemv_probe",\n' + "\n".join(",".join(f'"{c}"' for c in r) for r in [HDR] + ROWS))
    out = subprocess.run([sys.executable, str(ROOT / "scripts/ncu_stalls.py"), str(page), "--top", "2"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "gemv_probe: 3 instructions, 50 samples"
    # long_sb 28 of 50 samples, wait 22 of 50
    assert out[1].split() == ["long_sb", "56.0%", "wait", "44.0%"]
    assert out[2].split()[:4] == ["#1", "30", "60.0%", "STS.128"] and out[2].endswith("long_sb 27, wait 3")
    assert out[3].split()[:4] == ["#2", "15", "30.0%", "HMMA.16816.F32"]
    assert len(out) == 4


def test_not_a_source_page_is_one_line(tmp_path):
    page = tmp_path / "other.csv"
    page.write_text('"ID","Kernel"\n"1","x"\n')
    run = subprocess.run([sys.executable, str(ROOT / "scripts/ncu_stalls.py"), str(page)], capture_output=True, text=True)
    assert run.returncode != 0 and "not the CSV" in run.stderr and "Traceback" not in run.stderr
