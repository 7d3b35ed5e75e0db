"""``coc-inject bench``: measure CoC against unpatched Megatron on this machine or a cluster."""
