"""What the processes agree on beyond the protobuf messages (`rlfabric.v1`): the Redis keyspace
(`keys`), the proto <-> domain conversions (`wire`), the scored-group streams, the replica registry and
the policy lineage. A change here needs every process to agree.
"""
