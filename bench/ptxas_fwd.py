"""ptxas report of forward variants, CPU only: registers, spills, wgmma warnings, PTX md5.

    CUTE_DSL_ARCH=sm_90a python bench/ptxas_fwd.py [--varlen] [--dtype BFloat16] [--d 64 128]
        [--cfg persistent=1 packed_p_cvt=1] [--ptx-dir DIR]

One line per variant. The md5 of the PTX lets a change be checked to leave the default kernels
byte-identical (run before and after, compare). C7512/C7514/C7519 are ptxas's "wgmma
serialized" warnings (insufficient registers, and the like).
"""
import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flash_cute import dispatch  # noqa: E402
from flash_cute.config import SUPPORTED_HEAD_DIMS  # noqa: E402

PTXAS = os.environ.get("PTXAS", "/usr/local/bin/ptxas")


def ptxas_report(ptx: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([PTXAS, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True)
    text = res.stdout + res.stderr
    regs = re.findall(r"Used (\d+) registers", text)
    spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    warns = sorted(set(re.findall(r"\((C75\d\d)\)", text)))
    return {"regs": max(map(int, regs)) if regs else None,
            "spill": max((int(s) + int(l) for s, l in spill), default=0),
            "warn": ",".join(warns) or "-", "rc": res.returncode}


def parse_cfg(items):
    cfg = {}
    for it in items or ():
        k, v = it.split("=")
        cfg[k] = bool(int(v)) if v in ("0", "1") else int(v)
    return cfg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--varlen", action="store_true")
    ap.add_argument("--dtype", nargs="+", default=["BFloat16", "Float16"])
    ap.add_argument("--d", nargs="+", type=int, default=list(SUPPORTED_HEAD_DIMS))
    ap.add_argument("--causal", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--cfg", nargs="*", help="FwdSm90Config overrides, key=value")
    ap.add_argument("--ptx-dir", help="also write each PTX here")
    args = ap.parse_args()
    cfg = parse_cfg(args.cfg)
    for dt in args.dtype:
        for d in args.d:
            for c in args.causal:
                name = f"{dt}_d{d}{'_causal' if c else ''}{'_varlen' if args.varlen else ''}"
                try:
                    ptx = dispatch._compile_fwd(dispatch.DEFAULT_ARCH, dt, d, bool(c),
                                                args.varlen, keep_cubin="ptx", **cfg).__ptx__
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"{name:28s} compile error: {type(e).__name__}: {e}", flush=True)
                    continue
                if args.ptx_dir:
                    with open(os.path.join(args.ptx_dir, name + ".ptx"), "w") as f:
                        f.write(ptx)
                r = ptxas_report(ptx)
                md5 = hashlib.md5(ptx.encode()).hexdigest()
                print(f"{name:28s} regs={r['regs']} spill={r['spill']} warn={r['warn']} "
                      f"md5={md5}", flush=True)


if __name__ == "__main__":
    main()
