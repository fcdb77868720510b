"""The Qwen3-like decoder's workloads, qkvnp's :class:`~qkvnp.models.decoder.Decoder` and transformers' model.

Shape key: B batch, T tokens, V vocabulary, E embedding, L layers, H query
heads, K key/value heads, D head dim, F the MLP's width.

Two tasks, float32, each library in a worker process of its own
(:func:`serve`, the protocol of :mod:`harness.workers`):

- ``decode``: one call is a greedy generation at batch 1, a prompt of
  ``PROMPT`` tokens and ``NEW_TOKENS`` new ones, with KV caches:
  :func:`qkvnp.generate` against transformers'
  ``generate(do_sample=False)`` (its ``DynamicCache``);
- ``train``: one call is an AdamW step at ``(TRAIN_BATCH, TRAIN_TOKENS)``:
  zero the gradients, forward, cross-entropy, backward, step
  (:class:`qkvnp.optim.AdamW` against ``torch.optim.AdamW``).

The torch worker builds ``Qwen3ForCausalLM`` from :data:`QWEN3` with
seed 0 and writes its config and weights (``.npz``); the qkvnp worker reads
them through :func:`qkvnp.interop.from_hf` (never importing torch), so both
start from the same weights and their tokens and losses can be compared.
"""
import gc
import json
import sys
import time

import numpy as np

from benchmarks.harness.timing import calls_per_round

__all__ = ["QWEN3", "TINY", "PROMPT", "NEW_TOKENS", "TRAIN_BATCH", "TRAIN_TOKENS", "LR",
           "WEIGHT_DECAY", "make_runner", "step_products", "time_products", "time_core",
           "time_parts", "time_split", "serve"]

#: The measured configuration, transformers' ``Qwen3Config`` fields: 4 layers,
#: E 256, 4 query and 2 key/value heads of D 64, V 4096, F 768, untied head.
QWEN3 = {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "intermediate_size": 768, "max_position_embeddings": 512,
         "tie_word_embeddings": False}
#: A seconds-long stand-in for the tests.
TINY = dict(QWEN3, vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, intermediate_size=24)
PROMPT, NEW_TOKENS = 16, 64
TRAIN_BATCH, TRAIN_TOKENS = 8, 128
LR, WEIGHT_DECAY = 4e-4, 0.1
BATCHES = 4  # training batches drawn beforehand and cycled


def _data(config, seed=0):
    rng = np.random.default_rng(seed)
    V = config["vocab_size"]
    return {"prompt": rng.integers(0, V, (1, PROMPT)),
            "inputs": rng.integers(0, V, (BATCHES, TRAIN_BATCH, TRAIN_TOKENS)),
            "targets": rng.integers(0, V, (BATCHES, TRAIN_BATCH, TRAIN_TOKENS))}


class _Source:
    """What :func:`qkvnp.interop.from_hf` reads of a transformers model: ``.config`` and ``.state_dict()``."""

    class _Config(dict):
        def to_dict(self):
            return dict(self)

    def __init__(self, config, weights):
        self.config, self._weights = self._Config(config), weights

    def state_dict(self):
        return self._weights


class _Qkvnp:
    library = "qkvnp"

    def __init__(self, task, config, weights_path, threads):
        import contextlib

        from qkvnp.interop import from_hf
        from qkvnp.kernels import blas_threads, num_threads
        from qkvnp.models.decoder import Decoder, DecoderConfig

        self.pinned = contextlib.ExitStack()  # the threads, for the worker's life
        self.pinned.enter_context(blas_threads(threads))
        self.pinned.enter_context(num_threads(threads))
        self.task, self.data, self.index = task, _data(config), 0
        if weights_path:
            with np.load(weights_path) as stored:
                weights = {name: stored[name] for name in stored.files}
            with open(weights_path + ".json") as stored:  # transformers' whole config
                source = _Source(json.load(stored), weights)
            self.model = from_hf(source, dtype=np.float32)
        else:
            c = config
            self.model = Decoder(DecoderConfig.qwen3(
                vocab_size=c["vocab_size"], emb_dim=c["hidden_size"],
                num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
                num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                hidden_dim=c["intermediate_size"],
                context_length=c["max_position_embeddings"]), rng=0, dtype=np.float32)
        if task == "train":
            from qkvnp.losses import cross_entropy_backward, cross_entropy_forward
            from qkvnp.optim import AdamW

            self.optimizer = AdamW(self.model.params, lr=LR, weight_decay=WEIGHT_DECAY)
            self.loss_forward, self.loss_backward = cross_entropy_forward, cross_entropy_backward

    def call(self):
        if self.task == "decode":
            from qkvnp import generate

            return generate(self.model, self.data["prompt"], NEW_TOKENS)[0, PROMPT:].tolist()
        i = self.index % BATCHES
        self.index += 1
        model = self.model
        model.zero_grad()
        logits = model.forward(self.data["inputs"][i])  # (B, T) -> (B, T, V)
        loss, cache = self.loss_forward(logits, self.data["targets"][i])
        model.backward(self.loss_backward(1.0, cache))
        self.optimizer.step(model.grads)
        return float(loss)


class _Torch:
    library = "torch"

    def __init__(self, task, config, weights_path, threads):
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch, self.task, self.data, self.index = torch, task, _data(config), 0
        torch.manual_seed(0)
        self.model = transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(**config, attn_implementation="sdpa")).float()
        if weights_path:
            np.savez(weights_path, **{name: tensor.detach().numpy() for name, tensor
                                      in self.model.state_dict().items()})
            with open(weights_path + ".json", "w") as stored:
                json.dump(dict(self.model.config.to_dict(), architectures=["Qwen3ForCausalLM"]),
                          stored, default=str)
        if task == "train":
            self.model.train()
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR,
                                               weight_decay=WEIGHT_DECAY)
            self.batches = [(torch.from_numpy(self.data["inputs"][i]),
                             torch.from_numpy(self.data["targets"][i])) for i in range(BATCHES)]
        else:
            self.model.eval()
            self.prompt = torch.from_numpy(self.data["prompt"])

    def call(self):
        torch = self.torch
        if self.task == "decode":
            with torch.no_grad():
                out = self.model.generate(self.prompt, attention_mask=torch.ones_like(self.prompt),
                                          do_sample=False, max_new_tokens=NEW_TOKENS,
                                          min_new_tokens=NEW_TOKENS, pad_token_id=0)
            return out[0, PROMPT:].tolist()
        inputs, targets = self.batches[self.index % BATCHES]
        self.index += 1
        self.optimizer.zero_grad()
        logits = self.model(inputs).logits  # (B, T) -> (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        self.optimizer.step()
        return float(loss)


def make_runner(library, task, config, weights_path=None, threads=1):
    """A runner of ``task`` (``"decode"`` or ``"train"``) in ``library``: ``"qkvnp"``, ``"torch"``,
    or, training only, ``"qkvnp+torch-mm-sdpa"``, ``"qkvnp+torch-mm-sdpa-silu"`` and
    ``"qkvnp+torch-mm-sdpa-silu-unguarded"`` (qkvnp's step with torch's kernels, then
    without what its guarantees cost: :mod:`workloads.torch_kernels`)."""
    if library.startswith("qkvnp+torch-mm-sdpa"):
        from benchmarks.workloads.torch_kernels import TorchKernelsRunner

        silu, guarantees = "-silu" in library, not library.endswith("-unguarded")
        if library != TorchKernelsRunner.name(silu, guarantees):
            raise ValueError(f"unknown library {library!r}")
        if task != "train":
            raise ValueError(f"{library} runs the training task only, not {task!r}")
        return TorchKernelsRunner(_Qkvnp(task, config, weights_path, threads), silu, guarantees)
    return (_Torch if library == "torch" else _Qkvnp)(task, config, weights_path, threads)


def step_products(config, batch=TRAIN_BATCH):
    """The ``(a, b)`` shapes of every matrix product of one training step (forward and backward).

    Each linear ``(n_in, n_out)`` on ``N = B T`` rows: ``x W``, ``dy W^T``,
    ``x^T dy``; the attention core per head: ``q k^T``, ``w v`` and the
    backward's four. ``batch``: B (a share of the batch's, for the split).
    """
    c = config
    N, T = batch * TRAIN_TOKENS, TRAIN_TOKENS
    E, F, V, D = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    H, K = c["num_attention_heads"], c["num_key_value_heads"]
    linears = [(E, H * D), (E, K * D), (E, K * D), (H * D, E), (E, F), (E, F), (F, E)]
    linears = linears * c["num_hidden_layers"] + [(E, V)]
    products = []
    for n_in, n_out in linears:
        products += [((N, n_in), (n_in, n_out)), ((N, n_out), (n_out, n_in)),
                     ((n_in, N), (N, n_out))]
    heads = (batch, H)
    core = [((T, D), (D, T)), ((T, T), (T, D)),  # forward: scores, output
            ((T, D), (D, T)), ((T, T), (T, D)), ((T, T), (T, D)), ((T, T), (T, D))]  # backward
    products += [(heads + a, heads + b) for a, b in core] * c["num_hidden_layers"]
    return products


def time_products(config, repeats=5, seed=0, library="qkvnp"):
    """Best seconds of all of :func:`step_products` on random float32 arrays.

    ``library="torch"``: torch's ``matmul`` at its threads. ``"qkvnp"``: numpy's,
    as the decoder's training step runs them: at more than one thread each
    worker thread takes its share of the batch at one BLAS thread, the shares
    at once (:func:`qkvnp.kernels._runtime.run`, the blocks' batch split).
    """
    rng = np.random.default_rng(seed)
    threads = 1
    if library == "qkvnp":
        from qkvnp.kernels import get_num_threads

        threads = min(get_num_threads(), TRAIN_BATCH)
    shares = [[(rng.standard_normal(a, np.float32), rng.standard_normal(b, np.float32))
               for a, b in step_products(config, TRAIN_BATCH * (i + 1) // threads
                                         - TRAIN_BATCH * i // threads)]
              for i in range(threads)]
    matmul = np.matmul
    if library == "torch":
        import torch

        shares = [[(torch.from_numpy(a), torch.from_numpy(b)) for a, b in pairs]
                  for pairs in shares]
        matmul = torch.matmul

    def task(part):
        for i in part:
            for a, b in shares[i]:
                matmul(a, b)

    if threads > 1:
        from qkvnp.kernels._runtime import run

        def products():
            run(task, list(range(threads)))
    else:
        def products():
            task([0])
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        products()
        best = min(best, time.perf_counter() - start)
    return best


def time_core(config, repeats=5, seed=0, library="qkvnp"):
    """Best seconds of the step's attention cores alone, forward and backward of every layer.

    The shapes of the training step, float32: queries ``(B, H, T, D)``, keys and
    values ``(B, K, T, D)``, causal, grouped, scale ``D ** -0.5``; qkvnp's core as
    its training blocks call it (:func:`qkvnp.kernels.fast.attention_forward` with
    the shared causal mask) against torch's fused ``scaled_dot_product_attention``.
    """
    c = config
    B, T, H, K, D = (TRAIN_BATCH, TRAIN_TOKENS, c["num_attention_heads"],
                     c["num_key_value_heads"], c["head_dim"])
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(shape, np.float32)
              for shape in ((B, H, T, D), (B, K, T, D), (B, K, T, D), (B, H, T, D))]
    scale = D ** -0.5
    if library == "torch":
        import torch

        q, k, v = (torch.from_numpy(a).requires_grad_() for a in arrays[:3])
        dout = torch.from_numpy(arrays[3])

        def layer():
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            out.backward(dout)
    else:
        from qkvnp.kernels.fast import attention_backward, attention_forward
        from qkvnp.ops.masks import causal_mask

        q, k, v, dout = arrays
        keep = causal_mask(T, T)

        def layer():
            out, cache = attention_forward(q, k, v, keep, False, scale, enable_gqa=True)
            attention_backward(dout, cache)
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(c["num_hidden_layers"]):
            layer()
        best = min(best, time.perf_counter() - start)
    return best


def time_parts(runner, config, rounds):
    """The step and its parts, interleaved: ``rounds`` times a step, then the step's
    products alone, then its attention cores alone (one pass each, in the runner's
    library, :func:`time_products` and :func:`time_core`); the medians, in seconds,
    of each and of the rest of the step (``step - products - core``, round by round).

    Interleaved, the parts see the same state of the host as the step they are
    taken from, which separate runs of each do not.
    """
    rows = []
    for _ in range(rounds):
        start = time.perf_counter()
        runner.call()
        step = time.perf_counter() - start
        products = time_products(config, 1, library=runner.library)
        core = time_core(config, 1, library=runner.library)
        rows.append((step, products, core, step - products - core))
    step, products, core, rest = np.median(np.array(rows), axis=0)
    return {"step": float(step), "products": float(products), "core": float(core),
            "rest": float(rest)}


def time_split(runner, rounds):
    """What qkvnp's batch split costs in ``rounds`` steps of ``runner`` (medians, seconds a step).

    Each share of the fused blocks' forward and backward
    (:func:`qkvnp.kernels.decoder_train.stack_forward` and ``stack_backward``,
    one worker thread a share) is timed on the wall clock and on its thread's
    CPU clock, through a stand-in for the module's ``run`` that calls the
    real one:

    - ``imbalance``: the time a thread waits for the slowest share, summed over
      the step's forward and backward (the slowest share's wall time less the
      fastest's);
    - ``off_cpu``: the slowest share's wall time less its CPU time, summed
      likewise: the time its thread was not running (waiting for the GIL
      between numpy calls, or not scheduled by the host);
    - ``shares``: the shares of a call (0: the step ran no fused blocks, 1: no
      split; then both are 0).
    """
    from qkvnp.kernels import decoder_train

    real, phases = decoder_train.run, []

    def timed_run(task, work, flops=None):
        shares: list = []

        def timed(part):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                task(part)
            finally:
                shares.append((time.perf_counter() - start, time.thread_time() - cpu))

        real(timed, work, flops)
        phases.append(shares)

    rows, count = [], 0
    decoder_train.run = timed_run
    try:
        for _ in range(rounds):
            phases.clear()
            runner.call()
            count = max((len(shares) for shares in phases), default=0)  # 0: no fused blocks
            imbalance = off_cpu = 0.0
            for shares in phases:  # the forward's, then the backward's
                slowest_wall, slowest_cpu = max(shares)  # the share the others wait for
                imbalance += slowest_wall - min(wall for wall, _ in shares)
                off_cpu += slowest_wall - slowest_cpu
            rows.append((imbalance, off_cpu))
    finally:
        decoder_train.run = real
    imbalance, off_cpu = np.median(np.array(rows), axis=0) if count > 1 else (0.0, 0.0)
    return {"imbalance": float(imbalance), "off_cpu": float(off_cpu), "shares": count}


def _profile(runner, calls, top=15):
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        runner.call()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    total = sum(row[2] for row in stats.values())
    rows = sorted(((row[2], f"{func[2]} ({func[0].rsplit('/', 1)[-1]}:{func[1]})")
                   for func, row in stats.items()), reverse=True)[:top]
    return {"seconds": total, "calls": calls, "top": [[name, t / total] for t, name in rows]}


def serve():
    """The worker's loop: JSON commands on stdin, one JSON line each on stdout, until ``quit``.

    Commands: ``setup`` (``spec``: ``library``, ``task``, ``config``,
    ``weights`` path, ``threads``), ``outputs`` (``calls``: the tokens or
    losses of that many calls), ``calibrate`` and ``time`` (as
    :func:`harness.workers.time_alternating` sends them; the method is
    ignored: a runner has one call), ``profile`` (``calls``), ``parts``
    (``rounds``: :func:`time_parts`, the step and its products and cores
    alone in the worker's library, at its threads), ``split`` (``rounds``:
    :func:`time_split`, qkvnp's only).
    """
    protocol = sys.stdout
    sys.stdout = sys.stderr  # whatever the libraries print stays off the protocol
    runner = spec = None
    for line in sys.stdin:
        command = json.loads(line)
        op = command.get("op")
        if op == "quit":
            break
        try:
            if op == "setup":
                runner, spec = None, command["spec"]
                gc.collect()
                try:
                    runner = make_runner(spec["library"], spec["task"], spec["config"],
                                         spec.get("weights"), spec.get("threads", 1))
                    reply = {"library": runner.library}
                except ImportError as error:
                    reply = {"missing": "PyTorch is not installed (pip install 'qkvnp[torch]')"
                             if error.name == "torch" else
                             f"{error} (transformers comes with pip install 'qkvnp[test]')"}
            elif op == "outputs":
                reply = {"outputs": [runner.call() for _ in range(command["calls"])]}
            elif op == "calibrate":
                reply = {"calls": calls_per_round(runner.call, command["seconds"])}
            elif op == "time":
                gc.collect()
                start = time.perf_counter()
                for _ in range(command["calls"]):
                    runner.call()
                reply = {"seconds": time.perf_counter() - start}
            elif op == "profile":
                reply = _profile(runner, command["calls"])
            elif op == "parts":
                reply = time_parts(runner, spec["config"], command["rounds"])
            elif op == "split":
                reply = time_split(runner, command["rounds"])
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as error:
            reply = {"error": f"{type(error).__name__}: {error}"}
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()
