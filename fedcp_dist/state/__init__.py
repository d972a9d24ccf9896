"""Client state and where it lives: the per-client state store (device, host or disk; a client's
own BatchNorm statistics; checkpoint packing), and the placement of clients on ranks, the
cohorts and the seeded random streams (placement).
"""
