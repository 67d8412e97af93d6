"""The node's shared memory: every rank of a node maps the same windows, one owner per protocol.

- ``window``: the shm window of a node communicator, its counters and info lines, the
  handshake on them (arrive -> work -> depart, polled or waiting) and the rounds through its
  slots; ``ShmWork`` runs a node's calls one at a time, in issue order;
- ``registered``: registered buffers (``collectives.empty``), arrays in shared windows;
- ``cma``: single-copy reads from a peer's memory (``process_vm_readv``);
- ``shm``: ``algorithm="shm"``, collectives through the window's slots, callers of the window;
- ``onepass``: one-pass collectives on registered buffers, inside the window's handshake;
- ``composite``: the node composite (node stage, ring across nodes, node stage), under
  ``algorithm="hierarchical_shm"`` and the one-pass path on several nodes.
"""
__all__ = ["window", "registered", "cma", "shm", "onepass", "composite"]
