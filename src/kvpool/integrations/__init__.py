"""kvpool inside other libraries: `kvpool.integrations.transformers` (extra `transformers`)."""
