"""scripts/sass_loop.py's SASS reading (no cuobjdump needed): a hand-written listing with two nested loops, the
HMMA inside the inner one, counted by hand."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import sass_loop  # noqa: E402

LISTING = """
	code for sm_90a
		Function : k_one
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED"
        /*0000*/                   MOV R1, c[0x0][0x28] ;                                 /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                                     /* 0x0000000000007919 */
        /*0020*/                   LDS.128 R4, [R0] ;                                     /* 0x0000000000047984 */
        /*0030*/                   LOP3.LUT R8, R4, 0xf, RZ, 0xc0, !PT ;                  /* 0x0000000f04087812 */
        /*0040*/                   PRMT R9, R8, 0x1404, RZ ;                              /* 0x0000140408097816 */
        /*0050*/                   HMMA.16816.F32 R12, R8, R10, R12 ;                     /* 0x0000000a080c723c */
        /*0060*/              @!P0 LOP3.LUT R8, R5, 0xf, RZ, 0xc0, !PT ;                  /* 0x0000000f05088812 */
        /*0070*/                   HMMA.16816.F32 R12, R8, R10, R12 ;                     /* 0x0000000a080c723c */
        /*0080*/                   ISETP.NE.AND P0, PT, R0, RZ, PT ;                      /* 0x000000ff0000720c */
        /*0090*/               @P0 BRA 0x20 ;                                             /* 0xfffffff800000947 */
        /*00a0*/                   IADD3 R0, R0, 0x1, RZ ;                                /* 0x0000000100007810 */
        /*00b0*/               @P1 BRA 0x10 ;                                             /* 0xfffffff800000947 */
        /*00c0*/                   EXIT ;                                                 /* 0x000000000000794d */
		Function : k_two
        /*0000*/                   MOV R1, c[0x0][0x28] ;                                 /* 0x00000a0000017a02 */
        /*0010*/                   EXIT ;                                                 /* 0x000000000000794d */
"""


def test_opcodes_drop_predicates_and_modifiers():
    assert sass_loop.opcode("@!P0 LOP3.LUT R8, R5, 0xf, RZ, 0xc0, !PT") == "LOP3"
    assert sass_loop.opcode("HMMA.16816.F32 R12, R8, R10, R12") == "HMMA"


def test_inner_loop_is_the_shortest_span_around_the_op():
    first = sass_loop.instructions(LISTING.split("Function : k_two")[0])
    assert len(first) == 13
    body = sass_loop.inner_loop(first, "HMMA")
    # 0x20 .. the branch at 0x90 (the outer loop's back branch at 0xb0 to 0x10 is longer)
    assert [a for a, _ in body] == [0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90]
    ops = [sass_loop.opcode(t) for _, t in body]
    assert ops.count("LOP3") == 2 and ops.count("HMMA") == 2 and ops.count("PRMT") == 1
    with pytest.raises(ValueError):
        sass_loop.inner_loop(first, "HGMMA")


def test_functions_compare_without_addresses_or_encodings():
    f = sass_loop.functions(LISTING)
    assert set(f) == {"k_one", "k_two"}
    moved = LISTING.replace("/*0000*/", "/*1000*/").replace("0x00000a0000017a02", "0x1234567812345678")
    assert sass_loop.functions(moved) == f
    changed = LISTING.replace("PRMT R9, R8, 0x1404, RZ", "PRMT R9, R8, 0x3424, RZ")
    g = sass_loop.functions(changed)
    assert g["k_two"] == f["k_two"] and g["k_one"] != f["k_one"]
