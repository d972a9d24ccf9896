"""What travels between ranks: the round's one flat all-reduce and the peer exchange (aggregate),
compressed uploads and their byte counts (compress), and which clients send (selection).
"""
