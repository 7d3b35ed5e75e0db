"""MoE (``COC_MOE_OVERLAP``): the expert-parallel all-to-all of Megatron's ``alltoall`` token
dispatcher cut into pieces and pipelined against the local experts' compute.

layout.py    pure: which rows of the dispatcher's permuted buffer each piece sends, and the splits
function.py  the schedule, one autograd Function: dispatch a2a of piece p+1 and combine a2a of piece
             p in flight while piece p's expert computes; backward mirrored, in a fixed order
transfers.py one class per collective, a piece's chain of them
guards.py    what runs as pieces, else Megatron's path with the reason
counts.py    the pieces' row counts, taken to the host by Megatron's own device-to-host copy
calls.py     one layer call: its decision, its state (current for the length of the forward), its pieces
stages.py    which of Megatron's methods a call as pieces leaves (the layer's stages, or the dispatcher's)
install.py   the hooks: install() and the post-import hook on Megatron's MoE layer module
"""
