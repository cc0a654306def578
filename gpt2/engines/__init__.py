"""How one optimizer step runs in each mode: the Engine protocol and what every engine shares (base), torch
(single/DDP), DeepSpeed (+ its config), the non-finite guard, and build.
"""
