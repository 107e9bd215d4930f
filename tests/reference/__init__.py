"""Pure-PyTorch references for ops that have no layer with a forward_native."""
