"""
Attention weights of a six-token sentence
=========================================
"""
import numpy as np
print(np.ones(2))
