"""
Tied against separate query and key projections
===============================================

Could one matrix serve as both the query and the key projection? On the
*partner* task it cannot. Each key has a fixed partner; a sequence stores
key/value pairs including the query key ``a`` and its partner ``b``, and the
answer is the value stored under ``b``. With ``Q = K`` the score of ``x``
for ``y`` is ``x^T W W^T y``, symmetric: for every pair of partners one of
the two queries prefers its own entry (the pair bound, :doc:`/why_qkv`), so
tied ``Q = K`` answers about half at best. A short training shows it.
"""
import numpy as np

from qkvnp.training import TrainConfig, train
from qkvnp.training.ablation_report import pair_example

base = {"task": "partner", "steps": 500, "dim": 32, "eval_size": 500}
models = {}
for variant in ("separate", "tied_qk"):
    result = train(TrainConfig(**base, variant=variant))
    models[variant] = result.model
    print(f"{variant:>8}: held-out accuracy {result.heldout['accuracy']:.1%} "
          f"after {result.step} steps")

# %%
# Where the attention of the two queries ``a`` and ``b`` goes, over the same
# stored items: separate projections send each query to the other's entry;
# tied ones cannot do that for both.
weights, xlabels, ylabels = pair_example(models, seed=0, base=base)
for variant, w in weights.items():
    print(variant)
    for label, row in zip(ylabels, w):
        print(f"  {label:>10}: the largest weight is on {xlabels[int(np.argmax(row))]}")

try:
    import matplotlib.pyplot as plt
except ImportError:  # the plot is optional
    plt = None
if plt is not None:
    fig, axes = plt.subplots(2, 1, figsize=(9, 4), constrained_layout=True, sharex=True)
    for ax, (variant, w) in zip(axes, weights.items()):
        ax.imshow(w, cmap="viridis", vmin=0, vmax=1, aspect="auto")
        ax.set_yticks(range(2), ylabels)
        ax.set_title(variant)
    axes[-1].set_xticks(range(len(xlabels)), xlabels, rotation=60, fontsize=7)
    axes[-1].set_xlabel("stored item (key:value)")
    plt.show()
