"""Secure mode: job keys, sealing (AES-256-GCM) and the authenticated rendezvous.

    keys        the job key: generate, hand over (pipe line format), load, derive subkeys
    sealing     per-session AEAD with per-link sequence numbers; fault injection for tests
    rendezvous  mutual proof of the key over the rendezvous store before any group is built

Nothing here imports torch: the launcher uses :mod:`ringtrain.security.keys`. The sealed process
group and algorithms that move tensors live in :mod:`ringtrain.transport.ring` and
:mod:`ringtrain.transport.sealed_backend`. The threat model is in ``docs/security.md``.
"""
