"""MoE (``COC_MOE_OVERLAP``): the expert-parallel all-to-all of Megatron's ``alltoall`` token
dispatcher cut into pieces and pipelined against the local experts' compute.

layout.py   pure: which rows of the dispatcher's permuted buffer each piece sends, and the splits
function.py the schedule, one autograd Function: dispatch a2a of piece p+1 and combine a2a of piece
            p in flight while piece p's expert computes; backward mirrored, in a fixed order
guards.py   what runs as pieces, else Megatron's path with the reason
install.py  the hooks on Megatron's MoE layer, dispatcher and SequentialMLP
"""
