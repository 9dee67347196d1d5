"""The models daskflow-kv can load offline: tiny test models, SmolLM2-135M, any local path.

May import: ``daskflow_kv.model`` (the attention kernel it registers) and transformers.
"""
