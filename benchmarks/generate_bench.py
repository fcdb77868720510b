"""Greedy generation from a Hugging Face directory: qkvnp against transformers, tokens/s.

Usage::

    python benchmarks/generate_bench.py [--dir DIR] [--rounds 3] [--threads 1]
        [--prompt-tokens 16] [--new-tokens 32]

DIR is a ``save_pretrained`` directory; without one, a 124M-parameter GPT-2
(``GPT2LMHeadModel(GPT2Config())``, random weights, no download) is made in a
temporary directory (``load_bench.make_gpt2``). Each library runs in its own
fresh process, one after the other, ``--rounds`` times: qkvnp's
``from_hf(DIR, dtype=float32)`` and :func:`qkvnp.generate`, transformers'
``from_pretrained(DIR)`` and ``generate(do_sample=False)``, both at batch 1
from the same prompt, the same threads; a process generates once untimed,
then times five calls and reports their median. Before any figure is
printed, the two libraries' tokens must be the same.

It prints each round's tokens/s, the medians and their ratio (qkvnp over
transformers: above 1, qkvnp is faster).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(library, directory, threads, prompt_tokens, new_tokens):
    """Generate in this (fresh) process; print ``{"tokens_per_s", "tokens"}`` as JSON."""
    import time

    sys.path.insert(0, CHECKOUT)
    import numpy as np

    vocab = json.load(open(os.path.join(directory, "config.json")))["vocab_size"]
    prompt = np.random.default_rng(0).integers(0, vocab, (1, prompt_tokens))
    if library == "qkvnp":
        import qkvnp
        from qkvnp.interop import from_hf

        qkvnp.set_num_threads(threads)
        model = from_hf(directory, dtype=np.float32)

        def run():
            return qkvnp.generate(model, prompt, new_tokens)
    else:
        import torch
        import transformers

        torch.set_num_threads(threads)
        model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        model.generation_config.eos_token_id = None  # always new_tokens tokens
        ids = torch.from_numpy(prompt)

        def run():
            with torch.no_grad():
                return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      pad_token_id=0).numpy()
    tokens = run()  # untimed: warms the caches and the code
    times = []
    for _ in range(5):
        start = time.perf_counter()
        tokens = run()
        times.append(time.perf_counter() - start)
    print(json.dumps({"tokens_per_s": new_tokens / statistics.median(times),
                      "tokens": tokens[0].tolist()}))


def _run_child(library, directory, threads, prompt_tokens, new_tokens):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", library,
                          "--dir", directory, "--threads", str(threads),
                          "--prompt-tokens", str(prompt_tokens), "--new-tokens", str(new_tokens)],
                         capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(directory, rounds=3, threads=1, prompt_tokens=16, new_tokens=32):
    """Alternated rounds of both libraries; ``{"qkvnp": [...], "transformers": [...], "ratio"}``.

    Raises ``RuntimeError`` if the libraries' greedy tokens differ.
    """
    rates = {"qkvnp": [], "transformers": []}
    for _ in range(rounds):
        results = {library: _run_child(library, directory, threads, prompt_tokens, new_tokens)
                   for library in rates}
        if results["qkvnp"]["tokens"] != results["transformers"]["tokens"]:
            raise RuntimeError(f"the greedy tokens differ: qkvnp {results['qkvnp']['tokens']}, "
                               f"transformers {results['transformers']['tokens']}")
        for library, result in results.items():
            rates[library].append(result["tokens_per_s"])
    ratio = statistics.median(rates["qkvnp"]) / statistics.median(rates["transformers"])
    return {**rates, "ratio": ratio}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="a save_pretrained directory (default: a 124M GPT-2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--child", choices=("qkvnp", "transformers"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child, args.dir, args.threads, args.prompt_tokens, args.new_tokens)
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.dir
        if directory is None:
            sys.path.insert(0, CHECKOUT)
            from benchmarks.load_bench import make_gpt2

            directory = make_gpt2(os.path.join(scratch, "gpt2-124m"))
        result = measure(directory, args.rounds, args.threads, args.prompt_tokens,
                         args.new_tokens)
    for library in ("qkvnp", "transformers"):
        runs = ", ".join(f"{rate:.1f}" for rate in result[library])
        print(f"{library:>12}: {statistics.median(result[library]):.1f} tokens/s ({runs})")
    print(f"qkvnp / transformers: {result['ratio']:.2f} ({args.threads} thread(s), batch 1, "
          f"{args.prompt_tokens}-token prompt, {args.new_tokens} new)")


if __name__ == "__main__":
    main()
