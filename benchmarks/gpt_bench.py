"""GPTModel against the book's GPTModel in PyTorch: training steps and KV-cache decoding.

Shape key: B batch, T context, E width, H heads, L blocks, V vocabulary.

Usage, from the root of a checkout::

    python benchmarks/gpt_bench.py            # tiny and small, training and generation
    python benchmarks/gpt_bench.py --quick    # fewer repeats

Each measurement runs in a fresh process holding one library (so neither
library's threads or allocator disturb the other), with the thread count
given (default 2: OpenBLAS and PyTorch's intra-op pool), fixed seeds,
warm-up steps, then repeated timing; the median is reported, and the ratio
qkvnp / torch of steps (or tokens) per second is printed beside it.

- Training: one AdamW step (forward, cross-entropy, backward, update) in
  float32, dropout 0. Peak memory is the process's peak resident size
  after the step minus before the model was built (``ru_maxrss``).
- Generation: batch 1, greedy, a 16-token prompt then ``new`` tokens,
  each decoding step through a KV cache (qkvnp: :func:`qkvnp.generate`;
  torch: the book's bonus-chapter style cache written below).

The torch model is the oracle of ``tests/test_gpt_torch.py`` (the book's
chapter 4 GPT), imported from there.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {  # the sizes
    "tiny": {"vocab_size": 256, "context_length": 64, "emb_dim": 64, "n_heads": 4,
             "n_layers": 2, "drop_rate": 0.0, "qkv_bias": False, "batch": 8},
    "small": {"vocab_size": 256, "context_length": 128, "emb_dim": 128, "n_heads": 4,
              "n_layers": 4, "drop_rate": 0.0, "qkv_bias": False, "batch": 8},
}


def _median(values):
    values = sorted(values)
    return values[len(values) // 2]


def _rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _qkvnp_train(cfg, repeats):
    import numpy as np

    import qkvnp
    from qkvnp.losses import cross_entropy_backward, cross_entropy_forward
    from qkvnp.optim import AdamW

    rng = np.random.default_rng(0)
    B, T = cfg["batch"], cfg["context_length"]
    idx, targets = rng.integers(0, 256, (B, T)), rng.integers(0, 256, (B, T))
    before = _rss_mib()
    model = qkvnp.GPTModel.from_config({k: v for k, v in cfg.items() if k != "batch"}, rng=0,
                                       dtype=np.float32)
    optimizer = AdamW(model.params, lr=4e-4, weight_decay=0.1)

    def step():
        model.zero_grad()
        loss, cache = cross_entropy_forward(model.forward(idx), targets)
        model.backward(cross_entropy_backward(1.0, cache))
        optimizer.step(model.grads)

    return _time(step, repeats), _rss_mib() - before


def _torch_train(cfg, repeats):
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_gpt_torch import book_gpt

    torch.manual_seed(0)
    B, T = cfg["batch"], cfg["context_length"]
    idx, targets = torch.randint(0, 256, (B, T)), torch.randint(0, 256, (B, T))
    before = _rss_mib()
    model = book_gpt(torch)({k: v for k, v in cfg.items() if k != "batch"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1)

    def step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), targets.flatten()).backward()
        optimizer.step()

    return _time(step, repeats), _rss_mib() - before


def _qkvnp_generate(cfg, new, repeats):
    import numpy as np

    import qkvnp

    model = qkvnp.GPTModel.from_config({k: v for k, v in cfg.items() if k != "batch"}, rng=0,
                                       dtype=np.float32).eval()
    prompt = np.arange(16)[None] % 256
    return _time(lambda: qkvnp.generate(model, prompt, new), repeats) / new, None


def _torch_generate(cfg, new, repeats):
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_gpt_torch import book_gpt

    torch.manual_seed(0)
    model = book_gpt(torch)({k: v for k, v in cfg.items() if k != "batch"}).eval()

    def cached_logits(idx, caches, past):
        # the book's blocks, with each attention's keys and values kept (bonus KV-cache chapter)
        x = model.tok_emb(idx) + model.pos_emb(torch.arange(past, past + idx.shape[1]))
        for block, cache in zip(model.trf_blocks, caches):
            att, h = block.att, block.norm1(x)
            b, T, E = h.shape

            def split(y):
                return y.view(b, T, att.num_heads, att.head_dim).transpose(1, 2)

            q, k, v = split(att.W_query(h)), split(att.W_key(h)), split(att.W_value(h))
            if cache:
                k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
            cache[:] = [k, v]
            mask = torch.ones(T, k.shape[2], dtype=torch.bool).tril(k.shape[2] - T)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + att.out_proj(out.transpose(1, 2).reshape(b, T, E))
            x = x + block.ff(block.norm2(x))
        return model.out_head(model.final_norm(x))[:, -1]

    def generate():
        with torch.no_grad():
            idx = torch.arange(16)[None] % 256
            caches = [[] for _ in model.trf_blocks]
            logits = cached_logits(idx, caches, 0)
            for step in range(new):
                token = logits.argmax(dim=-1, keepdim=True)
                idx = torch.cat([idx, token], dim=1)
                if step + 1 < new:
                    logits = cached_logits(token, caches, idx.shape[1] - 1)
        return idx

    return _time(generate, repeats) / new, None


def _time(fun, repeats):
    for _ in range(3):  # warm-up
        fun()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fun()
        times.append(time.perf_counter() - start)
    return _median(times)


def _worker(args):
    """One measurement in this process: print its JSON."""
    cfg = CONFIGS[args.config]
    if args.library == "torch":
        import torch

        torch.set_num_threads(args.threads)
    else:
        import qkvnp

        qkvnp.set_num_threads(args.threads)
    runs = {("qkvnp", "train"): lambda: _qkvnp_train(cfg, args.repeats),
            ("torch", "train"): lambda: _torch_train(cfg, args.repeats),
            ("qkvnp", "generate"): lambda: _qkvnp_generate(cfg, args.new, args.repeats),
            ("torch", "generate"): lambda: _torch_generate(cfg, args.new, args.repeats)}
    seconds, mib = runs[(args.library, args.what)]()
    print(json.dumps({"seconds": seconds, "peak_mib": mib}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 repeats instead of 20")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new", type=int, default=64, help="tokens generated (default 64)")
    parser.add_argument("--worker", nargs=3, metavar=("LIBRARY", "WHAT", "CONFIG"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 20)
    if args.worker:
        args.library, args.what, args.config = args.worker
        args.repeats = repeats
        _worker(args)
        return 0
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads),
               OMP_NUM_THREADS=str(args.threads), PYTHONPATH=ROOT)
    print(f"GPTModel vs the book's GPTModel in torch; {args.threads} threads, float32, "
          f"median of {repeats}; one library per process")
    for config in CONFIGS:
        for what in ("train", "generate"):
            result = {}
            for library in ("qkvnp", "torch"):
                done = subprocess.run(
                    [sys.executable, __file__, "--worker", library, what, config, "--repeats",
                     str(repeats), "--threads", str(args.threads), "--new", str(args.new)],
                    capture_output=True, text=True, env=env)
                if done.returncode:
                    result[library] = None
                    print(f"  {library} {what} {config}: failed: "
                          f"{done.stderr.strip().splitlines()[-1:]}")
                else:
                    result[library] = json.loads(done.stdout.strip().splitlines()[-1])
            unit = "step" if what == "train" else "token"
            line = f"{config:5s} {what:8s}"
            for library in ("qkvnp", "torch"):
                if result[library]:
                    line += f"  {library} {1 / result[library]['seconds']:8.1f} {unit}s/s"
                    if result[library]["peak_mib"] is not None:
                        line += f" (+{result[library]['peak_mib']:.0f} MiB)"
            if result["qkvnp"] and result["torch"]:
                ratio = result["torch"]["seconds"] / result["qkvnp"]["seconds"]
                line += f"  qkvnp/torch speed {ratio:.2f}x"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
