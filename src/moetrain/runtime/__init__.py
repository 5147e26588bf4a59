"""The machine a run executes on: OS errors as one line (``oserrors``), memory pre-flight (``preflight``), CPU
features and bf16 policy (``cpu``), intra-op thread choice (``threads``)."""
