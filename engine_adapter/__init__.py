"""Engine adapter: attaches a real transformer model to kvsieve and runs the decoder DSL.

The only package that imports transformers.
"""
