"""The kernel interface, declared once.

Parameter structs, enums, flags, constants and size formulas that the host and the device
code share are declared here in Python (one module per concern). Generated from them
(``python -m megamoe_rt.kernels.interface``): the C++ headers in cuda_src/interface/, which
carry static_asserts of every size and offset, and ``structs.py``, the host's ctypes classes.
The host reads constants and formulas from the declarations directly. See docs/INTERFACE.md.
"""
