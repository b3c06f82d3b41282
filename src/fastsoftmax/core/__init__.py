"""What every layer uses and that imports nothing above it: argument checks, how a call composes with
PyTorch (routes, autocast, custom ops), the dtype registry, the layout of rows in memory, masks, the loss
options, the float64 oracle and the errors that cross modules."""
