"""The kernel interface, declared once.

Parameter structs, enums, flags, constants and size formulas that the host and the device
code share are declared here in Python (one module per concern). The C++ headers in
cuda_src/interface/ are generated from them (``python -m megamoe_rt.kernels.interface``) and
carry static_asserts of every size and offset; the host uses the same declarations for its
ctypes classes and numbers. See docs/INTERFACE.md.
"""
