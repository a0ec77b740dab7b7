"""Local attention kernels and the exact merge of partial attention results."""
