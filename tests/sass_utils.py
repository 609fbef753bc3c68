"""Reading a kernel's SASS on a CPU-only machine (nvdisasm from the test extra)."""
import glob
import os
import re
import struct
import subprocess

import pytest

from flash_cute.kernels.sm90.registers import REGISTER_FILE, WARPGROUP

ARCH = "sm_90a"


def nvdisasm_path():
    try:
        import nvidia.cu13  # noqa: F401
    except ImportError:
        return None
    for base in __import__("nvidia").__path__:
        hits = glob.glob(os.path.join(base, "cu13", "bin", "nvdisasm"))
        if hits:
            return hits[0]
    return None


def opcodes(sass: str) -> dict:
    """Counts per opcode, both bare (HGMMA) and with modifiers (WARPGROUP.ARRIVE)."""
    counts = {}
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass):
        full = m.group(1)
        for key in {full.split(".")[0], ".".join(full.split(".")[:2])}:
            counts[key] = counts.get(key, 0) + 1
    return counts


def sass_text(cubin: bytes, tmp_path) -> str:
    """A cubin's disassembly; skips the test (after checking the cubin) without nvdisasm."""
    assert cubin and cubin[:4] == b"\x7fELF", "no cubin came out"
    nvdisasm = nvdisasm_path()
    if nvdisasm is None:
        pytest.skip("nvdisasm not installed: cubin built, SASS not checked")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run([nvdisasm, "-c", str(path)], capture_output=True, text=True,
                          check=True).stdout
    assert_register_pool(cubin, sass)
    return sass


EIATTR_REGCOUNT = 0x2F   # .nv.info attribute: (symbol index, registers per thread)
EIFMT_SVAL = 0x04        # .nv.info entry format: a u16 size and that many bytes follow


def launch_registers(cubin: bytes) -> list:
    """Registers per thread each kernel of a cubin launches with (.nv.info REGCOUNT)."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize)
                for i in range(count)]
    strtab = sections[names][4]
    counts = []
    for sec in sections:
        name = cubin[strtab + sec[0]:cubin.index(b"\0", strtab + sec[0])]
        if name != b".nv.info":
            continue
        pos, end = sec[4], sec[4] + sec[5]
        while pos < end:
            fmt, attr = cubin[pos], cubin[pos + 1]
            if fmt != EIFMT_SVAL:  # the other formats are 4 bytes in all
                pos += 4
                continue
            if attr == EIATTR_REGCOUNT:
                counts.append(struct.unpack_from("<I", cubin, pos + 8)[0])
            pos += 4 + struct.unpack_from("<H", cubin, pos + 2)[0]
    return counts


def assert_register_pool(cubin: bytes, sass: str):
    """A warp-specialized kernel's setmaxnreg split fits the pool its CTA launches with
    (flash_cute/kernels/sm90/registers.py): one producer warpgroup at the largest DEALLOC
    value, every other at the largest TRY_ALLOC value, the warpgroup count the most a CTA at
    the cubin's per-thread register count can have. An increase past the pool never completes
    (a hang no compile error shows)."""
    dealloc = [int(v, 16) for v in re.findall(r"USETMAXREG\.DEALLOC\S*\s+(0x[0-9a-f]+)", sass)]
    alloc = [int(v, 16) for v in
             re.findall(r"USETMAXREG\.TRY_ALLOC\S*\s+\w+,\s*(0x[0-9a-f]+)", sass)]
    if not alloc:
        return
    regs = launch_registers(cubin)
    dealloc = dealloc or regs
    assert len(regs) == 1, f"one kernel per cubin expected, REGCOUNT entries {regs}"
    wgs = REGISTER_FILE // (regs[0] * WARPGROUP)
    need = WARPGROUP * (max(dealloc) + (wgs - 1) * max(alloc))
    assert need <= regs[0] * WARPGROUP * wgs, (
        f"setmaxnreg ({max(dealloc)}, {max(alloc)} x {wgs - 1}) needs {need} registers, the "
        f"CTA launches with {regs[0]} x {WARPGROUP * wgs}: the increase would never complete")


def sass_opcodes(cubin: bytes, tmp_path) -> dict:
    """Opcode counts of a cubin (see sass_text)."""
    return opcodes(sass_text(cubin, tmp_path))


def assert_wgmma_not_serialized(ops: dict):
    """ptxas serializes wgmma (warning C7512) when registers run short: every HGMMA then gets
    its own WARPGROUP.ARRIVE/DEPBAR and the tensor cores idle between them."""
    per_group = ops["HGMMA"] / max(ops.get("WARPGROUP.ARRIVE", 0), 1)
    assert per_group >= 1.5, f"wgmma serialized: {per_group:.1f} HGMMA per WARPGROUP.ARRIVE"


def require_arch():
    if os.environ.get("CUTE_DSL_ARCH", ARCH) != ARCH:
        pytest.skip(f"CUTE_DSL_ARCH={os.environ['CUTE_DSL_ARCH']}, these tests build {ARCH}")
