"""Wall time of a gradient check of the book's 124M GPTModel (163M parameters), float64.

Builds ``GPTModel(50257, 1024, 768, 12, 12)`` with random weights, in
evaluation mode, and runs ``check_layer(model, idx, mode="joint")`` on ids
of shape ``(1, T)``: random unit directions over all 163,009,536 parameters
at once, two forwards each. Prints the build time, the check's wall time,
the verdict and the table. Peak memory is about 8 GB (the model, the
checker's copy, its gradients, one direction and the saved parameters).

    python benchmarks/gradcheck_124m.py [--directions 4] [--tokens 4]
"""
import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import qkvnp  # noqa: E402
from qkvnp.gradcheck import check_layer  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directions", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--method", default="central")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    model = qkvnp.GPTModel(50257, 1024, 768, 12, 12, rng=0).eval()
    built = time.perf_counter() - start
    idx = np.random.default_rng(0).integers(0, 50257, size=(1, args.tokens))
    start = time.perf_counter()
    report = check_layer(model, idx, mode="joint", num_directions=args.directions,
                         method=args.method, progress=True)
    checked = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"{model.num_parameters():,} parameters; build {built:.1f} s; check {checked:.1f} s "
          f"wall; peak RSS {peak:.1f} GB; verdict {'OK' if report.ok else 'FAILED'}")
    print(report.table())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
