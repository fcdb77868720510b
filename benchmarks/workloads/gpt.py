"""The GPT benchmark's workloads, and the worker process that runs one library's.

Shape key: V vocabulary, C context length (the model's positions), T tokens of
every training window (at most C; C unless the config says otherwise), E
embedding, H heads, D = E // H, L layers, B batch (:class:`GPTConfig`).

Two workloads, each in qkvnp and in torch, from the same weights:

``train``
    One AdamW step (``lr`` 4e-4, ``weight_decay`` 0.1, the book's) of the
    book's GPT on a batch of ``B`` windows of ``T`` tokens, float32,
    dropout 0: zero the gradients, forward, cross-entropy over every
    position, backward, optimizer step, the loss read as a float. qkvnp:
    :class:`qkvnp.GPTModel`, :mod:`qkvnp.losses`, :class:`qkvnp.optim.AdamW`.
    torch: :func:`rivals.gpt_torch.book_gpt`, ``F.cross_entropy``,
    ``torch.optim.AdamW``. The batches are drawn beforehand and cycled.
``generate``
    Greedy decoding of batch 1 with a KV cache: a prompt of
    :data:`PROMPT_TOKENS` tokens, then new tokens up to the context.
    qkvnp: :func:`qkvnp.generate`; torch: :func:`rivals.gpt_torch.generate_cached`.

The weights are drawn by :class:`qkvnp.GPTModel` and written in the book's
state-dict names (:func:`qkvnp.interop.to_torch`, layout ``"book.GPTModel"``);
each library loads them from there.

The worker side (:func:`serve`) speaks the protocol of the harness's
``harness/workers.py`` (one JSON command a line: ``setup``, ``result``,
``calibrate``, ``time``), so that ``harness.workers.time_alternating`` times it,
and adds ``products`` (the step's matrix products on random arrays) and
``profile`` (cProfile of qkvnp's steps). :func:`memory_child` is the body of
the fresh process that measures a step's peak RSS, as the harness's
``harness/memory.py`` measures a layer's.
"""
import gc
import json
import sys
import time
from collections import namedtuple

import numpy as np

from benchmarks.harness.rss import proc_status_kib, reset_peak_rss
from benchmarks.harness.timing import calls_per_round

__all__ = ["GPTConfig", "CONFIGS", "LR", "WEIGHT_DECAY", "CHECK_STEPS", "LOSS_TOLERANCE",
           "PROMPT_TOKENS", "TORCH_THREADS", "LIBRARIES", "book_config", "make_data",
           "make_runner", "step_products", "products_flops", "time_products", "time_handoff",
           "serve",
           "memory_child"]


class GPTConfig(namedtuple("GPTConfig", "vocab context width heads layers batch tokens",
                           defaults=(None,))):
    """V vocabulary, C context, E width, H heads, L layers, B batch, T tokens a window.

    ``tokens`` None (the default, and what six numbers give) means T = C.
    """
    __slots__ = ()

    @property
    def seq_len(self):
        """T: the tokens of a training window, ``tokens`` or else the context."""
        return self.context if self.tokens is None else self.tokens


#: The training configurations that have targets; generation uses ``small`` with B = 1.
#: ``gpt2`` is the book's ``GPT_CONFIG_124M`` (untied head, 163M parameters) at 4 x 64 tokens.
CONFIGS = {"tiny": GPTConfig(256, 64, 64, 4, 2, 8), "small": GPTConfig(256, 128, 128, 4, 4, 8),
           "gpt2": GPTConfig(50257, 1024, 768, 12, 12, 4, 64)}
LR, WEIGHT_DECAY = 4e-4, 0.1
#: Batches drawn beforehand and cycled through.
BATCHES = 8
#: Steps from the shared weights whose losses must agree before timing.
CHECK_STEPS = 5
#: Largest relative difference of the two libraries' losses (float32; as the
#: harness's training benchmark).
LOSS_TOLERANCE = 1e-5
PROMPT_TOKENS = 8
#: PyTorch's threads; qkvnp runs with its defaults.
TORCH_THREADS = 2
LIBRARIES = ("qkvnp", "torch")
DTYPE = np.float32


def book_config(config):
    """The book's config dict (``GPT_CONFIG_124M``'s keys) of ``config``, dropout 0."""
    return {"vocab_size": config.vocab, "context_length": config.context,
            "emb_dim": config.width, "n_heads": config.heads, "n_layers": config.layers,
            "drop_rate": 0.0, "qkv_bias": False}


def make_data(config, seed=0):
    """Weights (the book's names), training batches and a prompt, as a flat dict of arrays.

    Keys: ``param/<book name>``, ``inputs`` and ``targets`` ``(BATCHES, B, T)``
    (targets are the inputs shifted by one token), ``prompt`` ``(1, PROMPT_TOKENS)``.
    """
    from qkvnp import GPTModel
    from qkvnp.interop import to_torch

    model = GPTModel.from_config(book_config(config), rng=seed, dtype=DTYPE)
    data = {"param/" + name: value for name, value in to_torch(model, "book.GPTModel").items()}
    rng = np.random.default_rng(seed + 1)
    windows = rng.integers(0, config.vocab, size=(BATCHES, config.batch, config.seq_len + 1))
    data["inputs"], data["targets"] = windows[..., :-1], windows[..., 1:]  # (BATCHES, B, T)
    data["prompt"] = rng.integers(0, config.vocab, size=(1, min(PROMPT_TOKENS, config.context)))
    return data


def _weights(data):
    return {name[len("param/"):]: value for name, value in data.items()
            if name.startswith("param/")}


class _Qkvnp:
    library = "qkvnp"

    def __init__(self, task, config, data, threads):
        from qkvnp import GPTModel
        from qkvnp.interop import from_torch

        self.task = task
        # NOTE: the batches and the prompt only: the weights (650 MB at gpt2) are copied
        # into the model below and need not stay alive beside it
        self.data = {key: data[key] for key in ("inputs", "targets", "prompt")}
        self.model = GPTModel.from_config(book_config(config), rng=0, dtype=DTYPE)
        from_torch(self.model, _weights(data), "book.GPTModel")
        self.index = 0
        if task == "train":
            from qkvnp.losses import cross_entropy_backward, cross_entropy_forward
            from qkvnp.optim import AdamW

            self.optimizer = AdamW(self.model.params, lr=LR, weight_decay=WEIGHT_DECAY)
            self.loss_forward, self.loss_backward = cross_entropy_forward, cross_entropy_backward
        else:
            self.model.eval()
        self.threads = threads

    def pinned(self):
        """qkvnp's defaults, or (threads=1) BLAS and the kernels' pool at one thread."""
        import contextlib

        from qkvnp.kernels import blas_threads, num_threads

        if self.threads != 1:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(blas_threads(1))
        stack.enter_context(num_threads(1))
        return stack

    def forward_backward(self):
        """One training step on the next batch; returns the loss."""
        inputs = self.data["inputs"][self.index % BATCHES]
        targets = self.data["targets"][self.index % BATCHES]
        self.index += 1
        model = self.model
        model.zero_grad()
        logits = model.forward(inputs)  # (B, T) -> (B, T, V)
        loss, cache = self.loss_forward(logits, targets)
        model.backward(self.loss_backward(1.0, cache))
        self.optimizer.step(model.grads)
        return float(loss)

    def forward(self):
        """Greedy decoding from the prompt up to the context; returns the tokens."""
        from qkvnp import generate

        prompt = self.data["prompt"]
        return generate(self.model, prompt, self.model.context_length - prompt.shape[1])


class _Torch:
    library = "torch"

    def __init__(self, task, config, data, threads):
        import torch

        from benchmarks.rivals.gpt_torch import book_gpt, generate_cached

        self.torch, self.task, self.index = torch, task, 0
        self.model = book_gpt(torch)(book_config(config))
        missing, unexpected = self.model.load_state_dict(
            {name: torch.from_numpy(np.ascontiguousarray(value))
             for name, value in _weights(data).items()}, strict=False)
        if unexpected or any(not name.endswith(".att.mask") for name in missing):
            raise ValueError(f"the weights do not fit the book's GPTModel: missing {missing}, "
                             f"unexpected {unexpected}")
        self.inputs = torch.from_numpy(data["inputs"])
        self.targets = torch.from_numpy(data["targets"])
        self.prompt = torch.from_numpy(data["prompt"])
        self.generate_cached = generate_cached
        if task == "train":
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR,
                                               weight_decay=WEIGHT_DECAY)
        else:
            self.model.eval()

    def pinned(self):
        import contextlib

        return contextlib.nullcontext()

    def forward_backward(self):
        """One training step on the next batch; returns the loss."""
        inputs = self.inputs[self.index % BATCHES]
        targets = self.targets[self.index % BATCHES]
        self.index += 1
        self.optimizer.zero_grad()
        logits = self.model(inputs)  # (B, T) -> (B, T, V)
        loss = self.torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def forward(self):
        """Greedy decoding from the prompt up to the context; returns the tokens."""
        context = self.model.pos_emb.num_embeddings
        return self.generate_cached(self.torch, self.model, self.prompt,
                                    context - self.prompt.shape[1]).numpy()


def _method(task):
    return "forward_backward" if task == "train" else "forward"


class _Runner:
    """One library's workload: ``forward_backward`` (a step) or ``forward`` (a generation)."""

    def __init__(self, impl, task):
        self.impl, self.task, self.library = impl, task, impl.library

    def repeat(self, method, calls):
        if method != _method(self.task):
            raise ValueError(f"the {self.task} workload times {_method(self.task)!r}, got "
                             f"{method!r}")
        call = getattr(self.impl, method)
        with self.impl.pinned():
            for _ in range(calls):
                call()

    def result(self):
        """The first CHECK_STEPS losses (train), or the generated tokens (generate)."""
        with self.impl.pinned():
            if self.task == "train":
                return {"loss": np.array([self.impl.forward_backward()
                                          for _ in range(CHECK_STEPS)])}
            return {"tokens": np.asarray(self.impl.forward())}


def make_runner(library, task, config, data, threads=None):
    """A runner of ``task`` ("train" or "generate") in ``library`` ("qkvnp" or "torch").

    Parameters
    ----------
    config : GPTConfig
    data : dict of ndarray or str
        :func:`make_data`'s dict, or the path of an ``.npz`` file holding it.
    threads : {None, 1}
        qkvnp: None for its defaults, 1 for BLAS and its pool at one thread
        (as ``python -m qkvnp train --task text`` runs). Ignored for torch,
        whose thread count the worker sets.

    Returns
    -------
    runner
        ``library``, ``repeat(method, calls)`` (what is timed: ``calls``
        steps or generations) and ``result()`` (a dict of arrays).
    """
    if task not in ("train", "generate"):
        raise ValueError(f"task must be 'train' or 'generate', got {task!r}")
    if library not in LIBRARIES:
        raise ValueError(f"library must be one of {LIBRARIES}, got {library!r}")
    if isinstance(data, str):
        with np.load(data, allow_pickle=False) as stored:
            data = dict(stored)
    config = GPTConfig(*config)
    if task == "generate":
        config = config._replace(batch=1)
    impl = (_Qkvnp if library == "qkvnp" else _Torch)(task, config, data, threads)
    return _Runner(impl, task)


# ---------------------------------------------------------------- matrix products


def step_products(config):
    """The matrix products of one training step: ``(count, m, k, n)``, count (m, k) @ (k, n) each.

    Forward, per block: the query, key, value and output projections
    ``(B*T, E) @ (E, E)``, per (batch, head) ``Q K^T`` ``(T, D) @ (D, T)`` and
    ``P V`` ``(T, T) @ (T, D)``, the feed-forward ``(B*T, E) @ (E, 4E)`` and
    ``(B*T, 4E) @ (4E, E)``; then the head ``(B*T, E) @ (E, V)``. Backward:
    each ``(m, k) @ (k, n)`` gives ``(m, n) @ (n, k)`` (the left operand's
    gradient) and ``(k, m) @ (m, n)`` (the right one's).

    >>> len(step_products(GPTConfig(256, 64, 64, 4, 2, 8)))  # (2 * 8 + 1) * 3
    51
    """
    V, _, E, H, L, B, _ = config
    T, D = config.seq_len, E // H
    forward = []
    for _ in range(L):
        forward += [(1, B * T, E, E)] * 3 + [(B * H, T, D, T), (B * H, T, T, D),
                                             (1, B * T, E, E), (1, B * T, E, 4 * E),
                                             (1, B * T, 4 * E, E)]
    forward.append((1, B * T, E, V))
    backward = [(count, m, n, k) for count, m, k, n in forward] + \
        [(count, k, m, n) for count, m, k, n in forward]
    return forward + backward


def products_flops(products):
    """2 * m * k * n summed over the products (one multiply-add = 2 FLOPs)."""
    return sum(2 * count * m * k * n for count, m, k, n in products)


def time_products(config, repeats=5, seed=0):
    """Median seconds of issuing every product of :func:`step_products` once, float32.

    Random operands of the same shapes; ``(count, m, k)`` stacks go through
    one ``np.matmul`` (numpy loops over the stack, as qkvnp's heads do).
    """
    rng = np.random.default_rng(seed)
    operands = []
    for count, m, k, n in step_products(config):
        lead = (count,) if count > 1 else ()
        operands.append((rng.standard_normal(lead + (m, k), dtype=DTYPE),
                         rng.standard_normal(lead + (k, n), dtype=DTYPE)))
    times = []
    for _ in range(repeats + 1):  # the first pass warms up, untimed
        start = time.perf_counter()
        for a, b in operands:
            np.matmul(a, b)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def time_handoff(rounds=2000):
    """Median seconds of handing work to a second Python thread and back (``threading.Event``).

    What any use of a second core costs an op of the step, whatever the
    pool: the other thread is woken, then wakes the caller. On a host
    whose idle CPUs sleep deeply (a VM), this is tens of microseconds.
    """
    import threading

    ping, pong = threading.Event(), threading.Event()

    def partner():
        for _ in range(rounds + 1):
            ping.wait()
            ping.clear()
            pong.set()

    thread = threading.Thread(target=partner, daemon=True)
    thread.start()
    times = []
    for _ in range(rounds + 1):
        start = time.perf_counter()
        ping.set()
        pong.wait()
        pong.clear()
        times.append(time.perf_counter() - start)
    thread.join()
    return float(np.median(times[1:]))


# ---------------------------------------------------------------- the worker process


def _profile(runner, steps, top=12):
    """cProfile of ``steps`` calls: the functions of largest own time, as (name, share)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    call = getattr(runner.impl, _method(runner.task))
    with runner.impl.pinned():
        call()  # lazy imports and first-call work stay out of the profile
        start = time.perf_counter()
        profiler.enable()
        for _ in range(steps):
            call()
        profiler.disable()
        total = time.perf_counter() - start
    stats = pstats.Stats(profiler).stats
    rows = sorted(((tottime, f"{func[2]} ({func[0].rsplit('/', 1)[-1]}:{func[1]})")
                   for func, (_, _, tottime, _, _) in stats.items()), reverse=True)[:top]
    return {"seconds": total, "steps": steps,
            "top": [[name, tottime / total] for tottime, name in rows]}


def serve():
    """The worker's loop: read JSON commands from stdin, answer one JSON line each, until ``quit``.

    Commands: ``setup`` (``spec``: ``library``, ``task``, ``config``,
    ``data`` path, ``threads``, ``torch_threads``), ``result`` (``path``:
    the ``.npz`` written), ``calibrate`` (``method``, ``seconds``), ``time``
    (``method``, ``calls``), ``products`` (``repeats``), ``profile``
    (``steps``). An exception becomes ``{"error": ...}``; a missing torch
    ``{"missing": ...}``.
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
                reply = {}
                if spec["library"] == "torch":
                    try:
                        import torch
                    except ImportError:
                        reply = {"missing": "PyTorch is not installed (pip install 'qkvnp[torch]')"}
                    else:
                        torch.set_num_threads(spec.get("torch_threads") or TORCH_THREADS)
                        reply = {"torch_threads": torch.get_num_threads()}
                if "missing" not in reply:
                    runner = make_runner(spec["library"], spec["task"], spec["config"],
                                         spec["data"], spec.get("threads"))
                    reply["library"] = runner.library
            elif op == "result":
                np.savez(command["path"], **runner.result())
                reply = {"saved": command["path"]}
            elif op == "calibrate":
                reply = {"calls": calls_per_round(lambda: runner.repeat(command["method"], 1),
                                             command["seconds"])}
            elif op == "time":
                gc.collect()
                start = time.perf_counter()
                runner.repeat(command["method"], command["calls"])
                reply = {"seconds": time.perf_counter() - start}
            elif op == "products":
                from qkvnp.kernels import blas_threads

                config = GPTConfig(*spec["config"])
                with runner.impl.pinned():
                    reply = {"seconds": time_products(config, command["repeats"])}
                with blas_threads(1):
                    reply["one_thread_seconds"] = time_products(config, command["repeats"])
                reply["handoff_seconds"] = time_handoff()
            elif op == "profile":
                reply = _profile(runner, command["steps"])
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as error:
            reply = {"error": f"{type(error).__name__}: {error}"}
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()


# ---------------------------------------------------------------- memory


def memory_child(spec_json):
    """Body of the fresh process that measures one library's training step; prints JSON.

    The library is warmed up on a 1-layer model of width 8 (thread pools,
    lazy imports), then the resident set is read (``base``); the model, its
    optimizer and the batches are built and one step is taken (the
    optimizers' state exists after it in both libraries); then the peak-RSS
    counter is reset and one more step runs. Reported, in MiB: ``step_mib``,
    the peak during that step minus the resident set just before it, and
    ``peak_mib``, the peak minus ``base``: weights, optimizer state,
    gradients and the step's activations (qkvnp keeps its gradient arrays
    between steps, torch frees them at ``zero_grad``; this one counts both
    alike). qkvnp also gets the ``tracemalloc`` peak of a third step.
    """
    import tracemalloc

    spec = json.loads(spec_json)
    library, config = spec["library"], GPTConfig(*spec["config"])
    if library == "torch":
        try:
            import torch
        except ImportError:
            print(json.dumps({"missing": "PyTorch is not installed (pip install 'qkvnp[torch]')"}))
            return
        torch.set_num_threads(spec.get("torch_threads") or TORCH_THREADS)
    warm = GPTConfig(config.vocab, 8, 8, 2, 1, 2)
    tiny = make_runner(library, "train", warm, make_data(warm), spec.get("threads"))
    tiny.repeat("forward_backward", 2)
    del tiny
    data = make_data(config)
    gc.collect()
    if not reset_peak_rss():
        print(json.dumps({"error": "/proc/self/clear_refs cannot be written: no peak RSS"}))
        return
    base = proc_status_kib("VmRSS")
    runner = make_runner(library, "train", config, data, spec.get("threads"))
    runner.repeat("forward_backward", 1)
    gc.collect()
    reset_peak_rss()
    before = proc_status_kib("VmRSS")
    runner.repeat("forward_backward", 1)
    peak = proc_status_kib("VmHWM")
    report = {"method": "rss", "step_mib": (peak - before) / 1024.0,
              "peak_mib": (peak - base) / 1024.0, "tracemalloc_mib": None}
    if library == "qkvnp":  # PyTorch's allocations are invisible to tracemalloc
        tracemalloc.start()
        runner.repeat("forward_backward", 1)
        report["tracemalloc_mib"] = tracemalloc.get_traced_memory()[1] / 2.0 ** 20
        tracemalloc.stop()
    print(json.dumps(report))
