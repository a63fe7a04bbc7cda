"""Model side of DFlash training: attention (masks), drafter, objective, target, export. Import the submodules."""
