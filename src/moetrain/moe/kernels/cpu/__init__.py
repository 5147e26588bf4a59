"""CPU execution machinery of the fused MoE path (moe/fast_moe.py): native elementwise kernels (``native``,
``native.c``), single-threaded expert workers (``workers``), scratch kept between calls (``workspace``) and 2 MiB
transparent huge pages (``hugepages``). None of it changes the maths; each module says what it measured."""
