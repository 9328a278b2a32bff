"""XIDs whose documented recovery is a GPU reset or a node reboot (NVIDIA's XID catalogue).
One list for the critical alert (alerts/build.py) and for preflight: a node that logged one
since boot should not start a job. Others (13, 31, 43, ...) are mostly application faults."""

HARDWARE_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    64: "ECC page retirement or row remapper failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}
