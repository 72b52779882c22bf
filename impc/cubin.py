"""The kernels a cubin defines, read from its ELF symbol table (so the launch program is checked against
what nvcc produced, not against what the source seemed to declare)."""
from __future__ import annotations

import struct

from impc.errors import CompileError

SHT_SYMTAB = 2
STT_FUNC = 2
STB_GLOBAL = 1


def kernel_symbols(cubin: bytes) -> set[str]:
    """Names of the global functions of an ELF64 little-endian cubin."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise CompileError("nvcc's output is not a 64-bit little-endian ELF cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names: set[str] = set()
    for _name, kind, _flags, _addr, off, size, link, _info, _align, entsize in sections:
        if kind != SHT_SYMTAB or not entsize:
            continue
        str_off = sections[link][4]
        for j in range(size // entsize):
            st_name, st_info = struct.unpack_from("<IB", cubin, off + j * entsize)
            if st_info & 0xF == STT_FUNC and st_info >> 4 == STB_GLOBAL:
                end = cubin.index(b"\0", str_off + st_name)
                names.add(cubin[str_off + st_name:end].decode())
    return names
