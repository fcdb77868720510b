"""llm.c's own C code reads a file written by ``save_llmc`` and computes qkvnp's loss.

A development check, not a test (llm.c is not a dependency): it builds a
small GPT-2 ``Decoder`` with random weights, writes it with
:func:`qkvnp.interop.save_llmc`, compiles a small C harness against llm.c's
``train_gpt2.c`` (its ``main`` renamed by the preprocessor, so
``gpt2_build_from_checkpoint`` and ``gpt2_forward`` are llm.c's own), runs it
on random tokens and compares its mean loss with qkvnp's on the same tokens
(the Decoder in float32 and in float64, the file read back by ``load_llmc``).

    python benchmarks/llmc_check.py --llmc PATH/TO/llm.c [--vocab 300 --layers 2 --std 0.1 ...]

``PATH/TO/llm.c`` is a checkout holding ``train_gpt2.c`` and ``llmc/``;
nothing of it is copied into this repository. Needs a C compiler (``--cc``).
"""
import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qkvnp.interop import load_llmc, save_llmc  # noqa: E402
from qkvnp.models.decoder import Decoder, DecoderConfig  # noqa: E402

# reads the checkpoint, then B*T inputs and B*T targets as int32 from a file
HARNESS = r"""
#define main llmc_main
#include "train_gpt2.c"
#undef main

int main(int argc, char **argv) {
    if (argc != 5) { fprintf(stderr, "usage: harness MODEL TOKENS B T\n"); return 2; }
    GPT2 model;
    gpt2_build_from_checkpoint(&model, argv[1]);
    size_t B = (size_t)atoi(argv[3]), T = (size_t)atoi(argv[4]);
    int *tokens = (int *)mallocCheck(2 * B * T * sizeof(int));
    FILE *f = fopenCheck(argv[2], "rb");
    freadCheck(tokens, sizeof(int), 2 * B * T, f);
    fcloseCheck(f);
    gpt2_forward(&model, tokens, tokens + B * T, B, T);
    printf("LLMC_MEAN_LOSS %.9g\n", model.mean_loss);
    free(tokens);
    gpt2_free(&model);
    return 0;
}
"""


def mean_loss(model, inputs, targets):
    """qkvnp's mean cross-entropy of ``targets`` given ``inputs``, reduced in float64."""
    logits = np.asarray(model(inputs), dtype=np.float64)  # (B, T, V)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    picked = np.take_along_axis(log_probs, targets[..., None], axis=-1)  # (B, T, 1)
    return float(-picked.mean())


def randomize(model, rng, std):
    """Weights of standard deviation ``std`` (GPT-2's is 0.02), every bias and norm non-trivial."""
    state = {}
    for name, value in model.params.items():
        noise = rng.normal(0.0, std, size=value.shape)
        state[name] = 1.0 + noise if name.endswith(".scale") else noise
    model.load_state_dict(state)


def compile_harness(llmc_dir, workdir, cc):
    """Compile the harness against ``llmc_dir``'s ``train_gpt2.c``; return the binary's path."""
    source = os.path.join(workdir, "harness.c")
    binary = os.path.join(workdir, "harness")
    with open(source, "w", encoding="utf-8") as f:
        f.write(HARNESS)
    command = [cc, "-O2", "-I", llmc_dir, source, "-o", binary, "-lm"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"compiling the harness failed:\n{' '.join(command)}\n{done.stderr}")
    return binary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llmc", required=True, help="llm.c checkout (train_gpt2.c, llmc/)")
    parser.add_argument("--cc", default="gcc")
    parser.add_argument("--vocab", type=int, default=300)
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--std", type=float, default=0.1, help="the weights' standard deviation")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.llmc, "train_gpt2.c")):
        parser.error(f"--llmc {args.llmc!r} has no train_gpt2.c")
    cfg = DecoderConfig.gpt2(vocab_size=args.vocab, emb_dim=args.channels,
                             num_layers=args.layers, num_heads=args.heads,
                             context_length=args.context)
    model = Decoder(cfg, rng=0, dtype=np.float32)
    rng = np.random.default_rng(0)
    randomize(model, rng, args.std)
    ids = rng.integers(0, args.vocab, size=(2, args.batch, args.tokens)).astype(np.int32)
    with tempfile.TemporaryDirectory() as workdir:
        path = os.path.join(workdir, "model.bin")
        save_llmc(model, path)
        ids.tofile(os.path.join(workdir, "tokens.bin"))  # inputs, then targets
        binary = compile_harness(os.path.abspath(args.llmc), workdir, args.cc)
        done = subprocess.run([binary, path, os.path.join(workdir, "tokens.bin"),
                               str(args.batch), str(args.tokens)], capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"llm.c's harness failed:\n{done.stdout}{done.stderr}")
        line = [row for row in done.stdout.splitlines() if row.startswith("LLMC_MEAN_LOSS")]
        llmc_loss = float(line[-1].split()[1])
        loaded32 = load_llmc(path)
        loaded64 = load_llmc(path, dtype=np.float64)
    inputs, targets = ids[0].astype(np.int64), ids[1].astype(np.int64)
    ours32 = mean_loss(loaded32, inputs, targets)
    ours64 = mean_loss(loaded64, inputs, targets)
    print(f"model: V={args.vocab} C={args.channels} L={args.layers} NH={args.heads} "
          f"maxT={args.context}; tokens B={args.batch} T={args.tokens}")
    print(f"llm.c (C, float32)            mean loss {llmc_loss:.9g}")
    print(f"qkvnp load_llmc float32       mean loss {ours32:.9g}  "
          f"rel. diff {abs(ours32 - llmc_loss) / abs(llmc_loss):.2e}")
    print(f"qkvnp load_llmc float64       mean loss {ours64:.9g}  "
          f"rel. diff {abs(ours64 - llmc_loss) / abs(llmc_loss):.2e}")
    return 0 if abs(ours64 - llmc_loss) <= 1e-5 * abs(llmc_loss) else 1


if __name__ == "__main__":
    sys.exit(main())
