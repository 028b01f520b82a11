"""The relay: leases on P (bound to one attempt, released once), the receiver on D (pull, fenced
commit), their wire protocol, and the sides both engine adapters assemble. Reaches an engine
only through port.py."""
