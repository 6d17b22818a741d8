"""`rlfabric up`: every service as a supervised process on one machine, the local scaler, the
eager-to-compiled hand-off and process management.
"""
