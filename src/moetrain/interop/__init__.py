"""Interoperability with other ecosystems: Hugging Face checkpoints in and out (:mod:`.hf`), the families and their
config/name mappings (:mod:`.families`), declared expert weight layouts (:mod:`.layouts`) and sparse upcycling of
dense checkpoints (:mod:`.upcycle`). transformers is imported lazily (the ``hf`` extra)."""
