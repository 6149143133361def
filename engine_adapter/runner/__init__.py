"""The model runner: a real transformer computing prompts on top of prefix KV from kvsieve.

Its modules, by role: `model` (loading SmolLM2 or any Llama shape), `engine` (`Engine`,
the facade: generate, prefill, decode, score), `prefill` with `layered`, `layered_policy`
and `topup` (the ways a prefix is loaded and computed on), `device` (how loaded KV reaches
the model's device), `cache`, `batchcache`, `array_layers` and `attention` (the model's KV
and attention hooks), `decode`, `sampling`, `chat` and `batch` (turning logits into answers).
"""
