"""The Communicator, ubnext's public collective API.

Owns: the Communicator and its public methods (``communicator``), the steps its calls are
made of (``calls``), call plans for repeated eager calls (``plans``), what it owns and
releases and the watchdog (``lifetime``), the ranks' agreement on what shapes their
kernels (``agreement``), and ``comm.describe()`` (``report``).
Imports: every layer below it; ``ubnext.torch`` only inside the call that torch.compile
traces.
"""
