"""The public operations, one module each: its public functions and nn.Modules, its custom ops
(core/compose.Op) and their autograd. Their implementations are dispatch.py's."""
