"""Gradient surgery (PCGrad, GEM) as Gram matrix -> task weights -> sum of weighted task gradients."""
