"""
Why the error against the step is a V
=====================================

A central difference ``(L(x + h) - L(x - h)) / 2h`` makes two errors: the
Taylor terms it leaves out, which shrink as ``h**2`` (slope +2 on log-log
axes), and the round-off of ``L`` divided by ``h``, which grows as ``1/h``
(slope -1). Their sum is a V whose bottom is the best a difference can do.
The fourth-order stencil ``central4`` moves the bottom down; complex step
has no subtraction, so it has no round-off branch at all.
:func:`qkvnp.gradcheck.sweep_steps` measures the curves and fits the slopes.
"""
import numpy as np

import qkvnp
from qkvnp.gradcheck import sweep_steps

rng = np.random.default_rng(0)
layer = qkvnp.SelfAttention(3, 2, qkv_bias=True, rng=0)
x = rng.standard_normal((4, 3))  # (T, E)
steps = 10.0 ** -np.arange(1, 11)  # h from 1e-1 to 1e-10, a decade apart

result = sweep_steps([("SelfAttention(3, 2)", layer, (x,), {})], eps_values=steps,
                     methods=("central", "central4", "complex_step"), dtypes=(np.float64,))

for entry in result["summary"]:
    best = int(np.argmin(entry["errors"]))
    print(f"{entry['method']:>12}: smallest worst-case relative error "
          f"{entry['errors'][best]:.1e} at h = {steps[best]:.0e}")

# %%
# Each curve is the worst relative error over every parameter and input of
# the layer. Where the curves bottom out is why a float64 check passes at a
# tolerance of about 1e-6 with central differences, and at 1e-12 with
# complex step.
try:
    import matplotlib.pyplot as plt
except ImportError:  # the plot is optional
    plt = None
if plt is not None:
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    for entry in result["summary"]:
        errors = np.maximum(entry["errors"], 1e-17)  # an exact 0 cannot go on a log axis
        ax.loglog(steps, errors, "o-", label=entry["method"])
    ax.invert_xaxis()
    ax.set_xlabel("step h")
    ax.set_ylabel("worst relative error")
    ax.set_title("float64, every gradient of SelfAttention(3, 2)")
    ax.legend()
    plt.show()
