"""K3 at cluster scale, simulated: GPUs and links, communication, step costs, a virtual clock."""
