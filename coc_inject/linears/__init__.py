"""The tensor-parallel linears' wing: Megatron's Column/Row forwards as N chunks against their
collective, or a fused kernel.

install.py (the hook: patch, undo) -> forward.py (the patched forward: guard, route, run, count)
-> guards.py (Megatron's path, and why), adapters.py (Row / Column calls), router.py (a call's
route: chunked, fused, tuned, Megatron's) -> ../pipeline/ (the chunked engine) and fused/ (fused
kernels). ops.py: the same operations on plain tensors, no Megatron needed.
Kept import-free: the interpreter bootstrap resolves ``coc_inject.linears.install`` by name.
"""
