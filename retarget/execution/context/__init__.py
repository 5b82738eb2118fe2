"""Context parallelism at step time: the split attention ops (attention.py), transformers'
attention interface routed to them (hf_attention.py), a whole batch cut to a rank's share of
the sequence and the whole loss put back together (batch.py), and the (dp, cp) mesh applied
to a compiled model (apply.py). Part of the execution layer."""
