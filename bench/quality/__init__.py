"""What a partial load costs the answer: `kvsieve bench quality` (partial loads simulated by
masking inside the real model's attention), `kvsieve bench longdoc` (the shipped loads through
`Engine` on long documents), and the scripts behind docs/importance.md's explorations."""
