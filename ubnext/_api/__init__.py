"""The Communicator, ubnext's public collective API.

Owns: the Communicator, its construction, lifetime and properties (``communicator``), its
collectives (``collectives``, one module each), the steps its calls are made of (``calls``), call plans for repeated eager calls (``plans``), what it owns and
releases and the watchdog (``lifetime``), the ranks' agreement on what shapes their
kernels (``agreement``), ``comm.describe()`` (``report``), and the int handle every
communicator has from construction, by which the torch ops name it (``handles``).
Imports: every layer below it; ``ubnext.torch`` only inside the call that torch.compile
traces (``traced``).
"""
