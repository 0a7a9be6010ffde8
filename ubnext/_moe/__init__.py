"""Expert parallelism: the mixture-of-experts dispatch and combine (docs/moe.md).

Owns: the checked sizes and the pool area of an expert-parallel object (``layout``), the
host reference of its kernels' arithmetic (``reference``), and the object itself, which
launches kernels/moe_dispatch.cu and kernels/moe_combine.cu (``expert_parallel``); the
throughput mode's sizes and area (``packed_layout``), its reference, the low-latency one laid
out packed (``packed_reference``), and its object, which launches
kernels/moe_packed_dispatch.cu and kernels/moe_packed_combine.cu (``packed``); and what both
objects do alike on the host, their base class (``base``: creation, a call's checks).
Imports: ``_protocol``, ``_interop``, ``_engine``, and ``_api.handles`` inside the base's
``_publish`` (each object's handle for the ubnext.torch.moe ops); the
Communicator it is made from comes as an argument (its call steps, launch section and pool area).
"""
