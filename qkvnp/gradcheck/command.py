"""``python -m qkvnp gradcheck``: check both attention layers' gradients numerically.

Builds :class:`qkvnp.SelfAttention` and :class:`qkvnp.MultiHeadAttention`
with the options' shapes and masks, runs :func:`qkvnp.gradcheck.check_layer`
on each with ``--method`` and prints the tables (exit status 1 on a
failure). Other studies of the same layers: ``--sweep-eps`` (the error
against the step, per tensor and method, with fitted slopes; ``--json``,
``--plot``), ``--oracle`` (the float32 backward of ``--impl`` against the
float64 reference), ``--second-order`` (symmetry of Hessian-vector
products); ``--gallery`` runs the broken backwards of
:mod:`qkvnp.gradcheck.gallery` instead.

Every option is checked before any layer is built: a bad one is argparse's
``error:`` line under the command's usage, exit status 2.
"""
import argparse
import math
import sys
import time

import numpy as np

from .checker import MODES, check_layer
from .report import TOLERANCES
from .stencils import METHODS
from .sweep import SWEEP_EPS, sweep_steps

__all__ = ["add_arguments", "run"]


def add_arguments(parser):
    """Add the ``gradcheck`` command's options to an ``argparse`` parser."""
    import argparse

    parser.add_argument("--batch", type=int, default=2, help="batch size B (default 2)")
    parser.add_argument("--seq", type=int, default=4, help="query length T (default 4)")
    parser.add_argument("--kv-seq", type=int, default=None,
                        help="key/value length S: cross-attention for MultiHeadAttention")
    parser.add_argument("--embed", type=int, default=6, help="embedding size E (default 6)")
    parser.add_argument("--heads", type=int, default=2, help="heads H, must divide E (default 2)")
    parser.add_argument("--d-out", type=int, default=4, help="SelfAttention output size (default 4)")
    parser.add_argument("--dtype", choices=("float64", "float32"), default=None,
                        help="dtype of the check (default float64)")
    parser.add_argument("--mask", choices=("none", "bool", "float", "padding"), default="none",
                        help="attention mask: random bool (with a fully masked row), random "
                             "float (with -inf entries) or key padding (one sequence fully padded)")
    parser.add_argument("--causal", nargs="?", const="top_left", default=None,
                        choices=("top_left", "bottom_right"),
                        help="causal mask, top-left aligned (--causal alone) or bottom_right")
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="MultiHeadAttention's num_kv_heads, a divisor of --heads "
                             "(grouped-query attention; default --heads)")
    parser.add_argument("--bias", action=argparse.BooleanOptionalAction, default=True,
                        help="projection biases (default: on)")
    parser.add_argument("--eps", type=float, default=None,
                        help="central-difference step (default: from TOLERANCES by dtype)")
    parser.add_argument("--mode", choices=MODES, default=None, help="default elementwise")
    parser.add_argument("--method", choices=METHODS, default=None,
                        help="numerical derivative (default central; complex_step checks the "
                             "reference path in float64)")
    from ..kernels import IMPLS

    parser.add_argument("--impl", choices=IMPLS, default="auto",
                        help="the layers' path (default auto)")
    parser.add_argument("--oracle", action="store_true",
                        help="compare the float32 backward of --impl with the float64 reference "
                             "backward (in float32 epsilons) instead of differences")
    parser.add_argument("--second-order", action="store_true",
                        help="check <v, Hu> = <u, Hv> with Hessian-vector products from "
                             "differences of the backward")
    parser.add_argument("--gallery", action="store_true",
                        help="run the gallery of deliberately broken backwards")
    parser.add_argument("--json", metavar="F", default=None,
                        help="with --sweep-eps: write the curves and fits to F as JSON")
    parser.add_argument("--plot", metavar="F", default=None,
                        help="with --sweep-eps: draw the curves to F (png/pdf/svg; needs "
                             "matplotlib)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random inputs, weights, masks and directions "
                             "(default 0)")
    parser.add_argument("--sweep-eps", action="store_true",
                        help="print the max relative error over eps = 1e-1 .. 1e-10 (half "
                             "decades) per "
                             "tensor, method and dtype, with fitted slopes, instead of checking")


# NOTE: an elementwise check costs two forwards per scalar: far beyond these
# sizes it would run for hours (and the inputs alone would not fit in memory)
MAX_SIZE = 4096  # each of --batch, --seq, --kv-seq, --embed, --heads, --d-out
MAX_ELEMENTS = 2**16  # the largest input or weight matrix (E = 128 already takes minutes)


def _positive(args, name):
    value = getattr(args, name)
    if value is None or not 1 <= value <= MAX_SIZE:
        raise ValueError(f"--{name.replace('_', '-')} must be a positive int <= {MAX_SIZE}, "
                         f"got {value}")
    return value


def _check_options(args):
    """Refuse a bad option or combination before any work (``argparse.ArgumentError``)."""
    try:
        B, T, E, H, d_out = (_positive(args, n) for n in ("batch", "seq", "embed", "heads", "d_out"))
        S = T if args.kv_seq is None else _positive(args, "kv_seq")
    except ValueError as exc:
        raise argparse.ArgumentError(None, str(exc)) from None
    if E % H:
        raise argparse.ArgumentError(None, f"--heads must divide --embed, got embed={E} and "
                                           f"heads={H}")
    if args.kv_heads is not None and not (1 <= args.kv_heads <= H and H % args.kv_heads == 0):
        raise argparse.ArgumentError(None, f"--kv-heads must divide --heads, got heads={H} and "
                                           f"kv-heads={args.kv_heads}")
    largest = max(B * max(T, S) * E, E * max(E, d_out))
    if largest > MAX_ELEMENTS:
        raise argparse.ArgumentError(None, f"sizes too large for a numerical check: an array "
                                           f"of {largest:,} elements (> {MAX_ELEMENTS:,})")
    if args.eps is not None and not (math.isfinite(args.eps) and args.eps > 0):
        raise argparse.ArgumentError(None, f"--eps must be a finite positive number, got "
                                           f"{args.eps}")
    if args.seed < 0:
        raise argparse.ArgumentError(None, f"--seed must be >= 0, got {args.seed}")
    studies = [f"--{name.replace('_', '-')}" for name in ("sweep_eps", "gallery", "oracle",
                                                          "second_order") if getattr(args, name)]
    if len(studies) > 1:
        raise argparse.ArgumentError(None, f"{' and '.join(studies)} are separate studies: "
                                           "choose one")
    if args.sweep_eps or args.gallery:
        given = [f"--{name}" for name in ("eps", "mode", "dtype", "method")
                 if getattr(args, name) is not None]
        if given:
            what = "--sweep-eps (it sweeps eps in both dtypes)" if args.sweep_eps else "--gallery"
            raise argparse.ArgumentError(None, f"{', '.join(given)} "
                                               f"{'does' if len(given) == 1 else 'do'} not apply "
                                               f"to {what}")
    if args.second_order or args.oracle:
        given = [f"--{name}" for name in ("eps", "mode", "method") if getattr(args, name) is not None]
        if given:
            what = ("--second-order (it differentiates the backward with its own step)"
                    if args.second_order else
                    "--oracle (it compares two backwards, with no numerical derivative)")
            raise argparse.ArgumentError(None, f"{', '.join(given)} "
                                               f"{'does' if len(given) == 1 else 'do'} not apply "
                                               f"to {what}")
    for name in ("json", "plot"):
        if getattr(args, name) is not None:
            if not args.sweep_eps:
                raise argparse.ArgumentError(None, f"--{name} applies to --sweep-eps only")
            from .._io import check_writable

            try:
                check_writable(getattr(args, name), f"--{name}")
            except (ValueError, OSError) as exc:
                raise argparse.ArgumentError(None, str(exc)) from None
    if args.plot is not None:
        from .plot import have_matplotlib

        if not have_matplotlib():  # refused before the sweep, which takes a while
            raise argparse.ArgumentError(None, f"--plot {args.plot}: matplotlib is not "
                                               "installed; install it with pip install "
                                               "'qkvnp[plot]' (or pip install matplotlib)")
    if args.method == "complex_step" and args.dtype == "float32":
        raise argparse.ArgumentError(None, "--method complex_step runs in float64 only "
                                           "(complex128 forwards)")


def _problems(args):
    """Build both layers, their inputs and forward kwargs from the CLI options.

    Returns a list of ``(title, layer, inputs, forward_kwargs)`` in float64.
    """
    from ..layers import MultiHeadAttention, SelfAttention

    B, T, E, H, d_out = args.batch, args.seq, args.embed, args.heads, args.d_out
    S = T if args.kv_seq is None else args.kv_seq
    is_causal = {None: False, "top_left": True, "bottom_right": "bottom_right"}[args.causal]
    rng = np.random.default_rng(args.seed)
    x = rng.normal(size=(B, T, E))

    def masks(T, S):
        """attn_mask (or None) of shape (B, 1, T, S) and a key padding mask (B, S)."""
        if args.mask == "bool":
            keep = rng.random((B, 1, T, S)) < 0.7
            keep[..., 0] = True  # every row keeps a key ...
            keep[0, 0, -1, :] = False  # ... except one fully masked row
            return keep, None
        if args.mask == "float":
            bias = rng.normal(size=(B, 1, T, S))
            bias[rng.random((B, 1, T, S)) < 0.2] = -np.inf
            return bias, None
        if args.mask == "padding":
            real = np.ones((B, S), dtype=bool)
            real[0, -1] = False  # one padded key ...
            real[-1, :] = False  # ... and, with B > 1, one fully padded sequence
            if B == 1:
                real[0, 0] = True
            return None, real
        return None, None

    def random_biases(layer):
        # NOTE: biases start at zero; check at a generic point where every path matters.
        for name, param in layer.params.items():
            if name.startswith("b_"):
                param[...] = rng.normal(scale=0.5, size=param.shape)
        return layer

    problems = []
    mask, padding = masks(T, T)
    if padding is not None:
        mask = padding[:, None, :]  # (B, S) -> (B, 1, S): broadcasts to (B, T, S)
    elif mask is not None:
        mask = mask[:, 0]  # (B, 1, T, S) -> (B, T, S)
    self_attention = random_biases(SelfAttention(E, d_out, qkv_bias=args.bias, rng=args.seed,
                                                 impl=args.impl))
    problems.append((f"SelfAttention(d_in={E}, d_out={d_out}, qkv_bias={args.bias})",
                     self_attention, (x,), {"attn_mask": mask, "is_causal": is_causal}))
    mha = random_biases(MultiHeadAttention(E, H, bias=args.bias, rng=args.seed, impl=args.impl,
                                           num_kv_heads=args.kv_heads))
    mask, padding = masks(T, S)
    kwargs = {"attn_mask": mask, "is_causal": is_causal, "key_padding_mask": padding}
    title = f"MultiHeadAttention(embed_dim={E}, num_heads={H}, bias={args.bias}"
    title += ")" if args.kv_heads is None else f", num_kv_heads={args.kv_heads})"
    if args.kv_seq is None:
        problems.append((title + ", self-attention", mha, (x,), kwargs))
    else:
        key, value = rng.normal(size=(B, S, E)), rng.normal(size=(B, S, E))
        problems.append((title + f", cross-attention T={T}, S={S}", mha, (x, key, value), kwargs))
    return problems


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def _print_sweep(problems, args, written):
    """The sweep's tables: worst central error per dtype, fits per method, best step per tensor."""
    print("max relative error of numerical gradients vs the float64 analytic gradient")
    print("(every param and input of: " + "; ".join(p[0] for p in problems) + ")")
    start = time.perf_counter()
    progress = None
    if sys.stderr.isatty():
        def progress(what):
            print(f"\r\033[K{what}", end="", file=sys.stderr, flush=True)
    result = sweep_steps(problems, progress=progress)
    if progress is not None:
        progress("")
    central = {}
    for entry in result["summary"]:
        if entry["method"] == "central":
            worst = central.setdefault(entry["dtype"], np.zeros(len(SWEEP_EPS)))
            np.maximum(worst, entry["errors"], out=worst)
    print(f"{'eps':>8}  " + "  ".join(f"{d:>10}" for d in central))
    for j, eps in enumerate(SWEEP_EPS):
        print(f"{eps:>8.0e}  " + "  ".join(f"{e[j]:>10.2e}" for e in central.values()))
    for dtype, e in central.items():
        j = int(np.argmin(e))
        print(f"best eps for {dtype}: {SWEEP_EPS[j]:.0e} (max rel err {e[j]:.2e}; "
              f"default eps {TOLERANCES[np.dtype(dtype)]['central'].eps:g})")
    print("large eps: truncation error O(eps^2); small eps: round-off O(eps_mach / eps)")
    print()
    print("fitted slopes of log(error) vs log(h), per layer, method and dtype:")
    print(f"{'method':<13} {'dtype':<8} {'truncation':>10} {'round-off':>9} {'best h':>7} "
          f"{'its error':>9} {'optimum h':>9}  layer")
    for entry in result["summary"]:
        print(f"{entry['method']:<13} {entry['dtype']:<8} "
              f"{_fmt(entry['truncation_slope'], '+.2f'):>10} "
              f"{_fmt(entry['roundoff_slope'], '+.2f'):>9} {_fmt(entry['best_eps'], '.0e'):>7} "
              f"{_fmt(entry['best_error'], '.2e'):>9} {_fmt(entry['optimal_eps'], '.1e'):>9}  "
              f"{entry['problem'].split('(')[0]}")
    print()
    print("best step and its error per tensor (float64):")
    for title in dict.fromkeys(c["problem"] for c in result["curves"]):
        print(f"  {title}")
        names = dict.fromkeys(c["tensor"] for c in result["curves"] if c["problem"] == title)
        for name in names:
            cells = []
            for curve in result["curves"]:
                if (curve["problem"], curve["tensor"], curve["dtype"]) == (title, name, "float64"):
                    j = int(np.argmin(curve["errors"]))
                    cells.append(f"{curve['method']} {SWEEP_EPS[j]:.0e}: {curve['errors'][j]:.1e}")
            print(f"    {name:<14} " + ";  ".join(cells))
    if any(np.isinf(c["errors"]).any() for c in result["curves"]):
        print("inf: x + eps rounds back to x for some entry (eps below the float spacing)")
    if args.json is not None:
        import json

        from .._io import atomic_write

        with atomic_write(args.json, mode="w") as f:
            json.dump(result, f, indent=1)
        written.append(f"--json {args.json}")
        print(f"curves written to {args.json}")
    if args.plot is not None:
        from .plot import plot_sweep

        plot_sweep(result, args.plot)
        written.append(f"--plot {args.plot}")
    print(f"({time.perf_counter() - start:.1f} s)")


def _print_second_order(problems, dtype):
    all_ok = True
    for title, layer, inputs, forward_kwargs in problems:
        from .second_order import check_symmetry_layer

        report = check_symmetry_layer(layer, *inputs, forward_kwargs=forward_kwargs, dtype=dtype)
        print(f"{title}\n  <v, Hu> = {report.v_hu:+.12e}, <u, Hv> = {report.u_hv:+.12e}, "
              f"relative asymmetry {report.relative:.2e} (h = {report.eps:g}, pass <= "
              f"{report.rtol:g}): {'OK' if report.ok else 'FAILED'}")
        all_ok &= report.ok
    return all_ok


def run(args):
    """Run the ``gradcheck`` command; return 0 if every gradient is right, else 1.

    Raises
    ------
    argparse.ArgumentError
        For a bad option, before any work; ``qkvnp.apps.cli.main`` prints it under
        the command's usage and returns 2.
    """
    _check_options(args)
    written = []
    try:
        return _run_checked(args, written)
    except KeyboardInterrupt as exc:
        from ..apps.cli import report_interrupt

        files = [f"--{name} {getattr(args, name)}" for name in ("json", "plot")
                 if getattr(args, name) is not None]
        if not files:
            kept = "the tables printed above are complete, the rest was not run"
        elif written:
            kept = f"{' and '.join(written)} written, the rest not"
        else:
            kept = f"nothing was written ({', '.join(files)} not created or changed)"
        return report_interrupt(exc, f"gradcheck stopped before it finished; {kept}")


def _run_checked(args, written):
    """:func:`run` after the options' checks; ``written`` collects the files written."""
    if args.gallery:
        from .gallery import run_gallery

        ok = run_gallery()
        print("every broken backward caught and diagnosed, every correct one passed" if ok
              else "GALLERY: a case did not behave as documented")
        return 0 if ok else 1
    problems = _problems(args)
    if args.sweep_eps:
        _print_sweep(problems, args, written)
        return 0
    dtype = np.dtype(args.dtype or "float64")
    if args.second_order:
        return 0 if _print_second_order(problems, dtype) else 1
    mode = args.mode or "elementwise"
    all_ok = True
    for title, layer, inputs, forward_kwargs in problems:
        if args.oracle:
            report = check_layer(layer, *inputs, forward_kwargs=forward_kwargs,
                                 dtype=np.dtype(args.dtype or "float32"),
                                 oracle_dtype=np.float64, rng=args.seed)
        else:
            report = check_layer(layer, *inputs, forward_kwargs=forward_kwargs, mode=mode,
                                 method=args.method or "central", dtype=dtype, eps=args.eps,
                                 rng=args.seed)
        print(title)
        if getattr(report, "dispatch", None) is not None:
            print(f"path checked: {report.dispatch.reason}")
        print(report.table())
        print()
        all_ok &= report.ok
    print("all gradients OK" if all_ok else "GRADIENT CHECK FAILED")
    return 0 if all_ok else 1
