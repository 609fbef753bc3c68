"""Decide from bench/exp_bwd.py logs whether a variant beats the default, for a later step of
the same device call (the device time allows one call, so the decision cannot wait for a human).

    python bench/pick_variant.py tma_epi tma_epilogue=1 $OUT/step1.log $OUT/step2.log

Prints the FLASH_CUTE_BWD_CONFIG value to use (the given setting, or nothing) and, on stderr,
the per-shape ratios. The variant wins when it passed every oracle check in the logs, its
geometric-mean speed-up is at least MIN_GEOMEAN and no shape loses more than MAX_LOSS.
"""
import math
import re
import sys

MIN_GEOMEAN = 1.01  # below this the difference is within the run-to-run noise of one call
MAX_LOSS = 0.97     # a variant that costs some shape more than 3% is not a default


def main():
    name, setting, *logs = sys.argv[1:]
    text = "".join(open(p).read() for p in logs)
    ratios = []
    for line in text.splitlines():  # "bwd d=... TFLOP/s: default=554 tma_epi=558 ..."
        speeds = dict(re.findall(r"(\w+)=(\d+)", line.partition("TFLOP/s:")[2]))
        if "default" in speeds and name in speeds:
            ratios.append(int(speeds[name]) / int(speeds["default"]))
    failed = re.search(rf"{name}: FAIL", text) is not None
    for r in ratios:
        print(f"{name} / default: {r:.3f}", file=sys.stderr)
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else 0.0
    wins = not failed and ratios and geomean >= MIN_GEOMEAN and min(ratios) >= MAX_LOSS
    print(f"{name}: failed={failed} geomean={geomean:.3f} -> {'on' if wins else 'off'}",
          file=sys.stderr)
    print(setting if wins else "")


if __name__ == "__main__":
    main()
