"""`kvsieve bench dsl`: a workflow written in the decoder DSL (engine_adapter/dsl) as one program,
against the same steps as separate calls with and without prefix reuse."""
