"""kvsieve beside SGLang, measured with SGLang's own code in its own environment
(setup_sglang.sh): `kvsieve bench radix` (the radix index against SGLang's RadixCache) and
`kvsieve bench sglang` (kvsieve as SGLang's HiCache storage); the drivers run in that environment."""
