"""bake"""
