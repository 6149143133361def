"""The load path: plan a budget's chunks, read and verify them from the tiers, assemble them.

`plan` chooses (pure, from block metadata); `read` and `fetch` read chunk records and
layer records fastest tier first; `read_layered` and `layer_by_layer` join the layered
layout's records; `stream` and `assemble` hand the chunks to the caller and copy them
into one array; `device` and `buffers` are the host-memory side of a copy to a GPU.
"""
