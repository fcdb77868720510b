"""
RoPE's relative-position property, numerically
==============================================

A query at position m and a key at position n, both rotated by RoPE, give a
score that depends only on n - m: R(theta_m)^T R(theta_n) = R(theta_n - theta_m).
"""
import numpy as np

from qkvnp.functional import rope_backward, rope_forward

rng = np.random.default_rng(0)
D = 16
q, k = rng.standard_normal(D), rng.standard_normal(D)


def score(m, n, layout="half"):
    """q at position m, k at position n, both rotated, then their dot product."""
    q_rotated, _ = rope_forward(q[None], np.array([m]), layout=layout)  # (1, D)
    k_rotated, _ = rope_forward(k[None], np.array([n]), layout=layout)  # (1, D)
    return float(q_rotated[0] @ k_rotated[0])


print("score(m, n) for the same offset n - m = 3 at different places:")
for m in (0, 5, 100, 4000):
    print(f"  m={m:5d}, n={m + 3:5d}: {score(m, m + 3):+.12f}")
print("and for other offsets (the score changes with n - m):")
for offset in (-3, 0, 1, 7):
    print(f"  n - m = {offset:+d}: {score(10, 10 + offset):+.12f}")

spread = max(score(m, m + 3) for m in range(0, 500, 7)) - min(score(m, m + 3) for m in range(0, 500, 7))
print(f"largest difference over 72 positions at offset 3: {spread:.2e} (round-off)")
assert spread < 1e-10

# RoPE is a rotation: it keeps lengths, and its backward rotates back
x = rng.standard_normal((5, D))
y, cache = rope_forward(x, np.arange(5) * 11)
assert np.allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1))
assert np.allclose(rope_backward(y, cache), x)  # R^T R x = x
print("norms kept; rope_backward(rope_forward(x)) == x: the backward is the inverse rotation")

# %%
# The score against the offset n - m, for a query at three places: the
# curves lie on one another, so the score sees only the offset.
offsets = np.arange(-24, 25)

try:
    import matplotlib.pyplot as plt
except ImportError:  # the plot is optional
    plt = None
if plt is not None:
    figure, axis = plt.subplots(figsize=(7, 4), constrained_layout=True)
    for m, style in ((0, "-"), (100, "--"), (4000, ":")):
        axis.plot(offsets, [score(m, m + o) for o in offsets], style, lw=2, label=f"query at m = {m}")
    axis.set_xlabel("offset n - m of the key")
    axis.set_ylabel("score q_m . k_n after RoPE")
    axis.set_title("RoPE: the score depends on n - m only")
    axis.legend()
    plt.show()
